"""Publish overhead: what ``publish()`` adds to a user's transaction, against the
floor of one raw multi-row INSERT of the same rows on the same connection.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench1 \\
        .venv/bin/python -m bench.bench_overhead [--transactions 1500] [--rounds 3]

Variants, one transaction each: ``Order.objects.create`` alone; plus ``publish()``
of 1 and of 5 events; plus one raw ``INSERT ... VALUES (...), (...)`` of the same
1 or 5 rows (same columns, same values, built per transaction) through
``cursor.execute``. Rounds interleave the variants; 1 and 2 client processes.
The goal compares time per transaction beyond the bare ``Order`` insert:
(publish k - order) / (raw k - order) <= 1.1.
"""

from __future__ import annotations

import argparse
import decimal
import json
import multiprocessing
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections, transaction  # noqa: E402
from django.test.utils import CaptureQueriesContext  # noqa: E402
from django.utils import timezone  # noqa: E402

from outbox_app import OutboxEvent, publish  # noqa: E402
from outbox_app.conf import outbox_settings  # noqa: E402
from outbox_app.events.ids import new_event_id  # noqa: E402
from outbox_app.publishing.outbox import events_committed  # noqa: E402
from outbox_app.relay.wake import wake_relays  # noqa: E402
from outbox_app.store.gateway import streaming  # noqa: E402
from outbox_app.store.sql import dialect  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402
from tests.testapp.models import Order  # noqa: E402

VARIANTS = ["order", "publish1", "raw1", "publish5", "raw5"]
COLUMNS = [
    "id", "namespace", "event_type", "revision", "aggregate_type", "aggregate_id",
    "aggregate_version", "payload", "headers", "tenant_id", "occurred_at",
    "created_at", "fanned_out",
]  # fmt: skip


def raw_insert(order: Order, k: int) -> None:
    """The floor: the rows publish() writes, as one hand-written INSERT."""
    now = timezone.now()
    if connection.vendor != "postgresql":
        now = connection.ops.adapt_datetimefield_value(now)
    payload = json.dumps({"order_id": order.pk, "total": str(order.total)})
    fanned_out = None if streaming() else False  # as publish() writes it
    row = [
        outbox_settings.NAMESPACE, "testapp.OrderPlaced", 1, "testapp.Order",
        str(order.pk), None, payload, "{}", None, now, now, fanned_out,
    ]  # fmt: skip
    params: list = []
    for _ in range(k):
        event_id = new_event_id()
        params += [event_id if connection.vendor == "postgresql" else event_id.hex]
        params += row
    one = "(" + ", ".join(["%s"] * len(COLUMNS)) + ")"
    sql = (
        f"INSERT INTO {connection.ops.quote_name(OutboxEvent._meta.db_table)} "
        f"({', '.join(connection.ops.quote_name(c) for c in COLUMNS)}) "
        f"VALUES {', '.join([one] * k)}"
    )
    with connection.cursor() as cursor:
        cursor.execute(sql, params)


def transaction_of(variant: str, i: int) -> None:
    with transaction.atomic():
        order = Order.objects.create(reference=f"o{i}", total=decimal.Decimal(i))
        if variant.startswith("publish"):
            k = int(variant[len("publish") :])
            publish(
                *[OrderPlaced(order_id=order.pk, total=order.total)] * k,
                aggregate=order,
            )
        elif variant.startswith("raw"):
            raw_insert(order, int(variant[len("raw") :]))


def run(variant: str, n: int, start: multiprocessing.Barrier | None = None) -> float:
    """Seconds per transaction of ``variant``, over ``n`` transactions."""
    connections.close_all()
    transaction_of(variant, -1)  # connect outside the clock
    if start is not None:
        start.wait()
    began = time.perf_counter()
    for i in range(n):
        transaction_of(variant, i)
    return (time.perf_counter() - began) / n


def _child(args: tuple) -> float:
    variant, n, barrier = args
    return run(variant, n, barrier)


def throughput(variant: str, n: int, clients: int, pool, barrier) -> float:
    """Transactions/s of all clients together."""
    if clients == 1:
        return 1 / run(variant, n)
    per_tx = pool.map(_child, [(variant, n, barrier)] * clients)
    return clients / max(per_tx)


def publish_five() -> list[str]:
    """The statements of ``publish()`` of 5 events, in a transaction of its
    own (committed)."""
    with transaction.atomic():
        order = Order.objects.create(reference="q", total=decimal.Decimal(1))
        with CaptureQueriesContext(connection) as captured:
            publish(*[OrderPlaced(order_id=order.pk, total=order.total)] * 5)
    return [q["sql"] for q in captured.captured_queries]


def check_one_statement() -> None:
    """``publish()`` is one INSERT into the outbox table. The first publish()
    of a process may also send what a process does once: with stream
    delivery, read which of its subscribers have cursors, creating the
    missing ones (once per change of its subscribers,
    ``outbox_app.apps._know_subscribers``), and read the database's clock
    (then every 60 s, ``outbox_app.store.clock``); allowed there, not after."""
    table = connection.ops.quote_name(OutboxEvent._meta.db_table)
    clock = dialect(connection.alias).clock_sql
    for first in (True, False):
        statements = publish_five()
        inserts = [s for s in statements if s.startswith(f"INSERT INTO {table}")]
        others = [s for s in statements if s not in inserts]
        print(
            f"publish() of 5 events, {'first' if first else 'next'} in the "
            f"process: {len(inserts)} INSERT, {len(others)} other statement(s)"
        )
        assert len(inserts) == 1, statements
        assert not others or (
            first and all("outbox_app_cursor" in s or s == clock for s in others)
        ), others


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", default="1,2")
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    # The wake-up is measured by bench_notify; here only the INSERT is compared.
    events_committed.disconnect(wake_relays, dispatch_uid="outbox_app.wake_relays")
    check_one_statement()
    ctx = multiprocessing.get_context("fork")
    summary: dict[int, dict[str, float]] = {}
    for clients in [int(c) for c in args.clients.split(",")]:
        connections.close_all()
        barrier = ctx.Manager().Barrier(clients) if clients > 1 else None
        pool = ctx.Pool(clients) if clients > 1 else None
        rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for _ in range(args.rounds):
            for v in VARIANTS:
                rates[v].append(
                    throughput(v, args.transactions, clients, pool, barrier)
                )
        if pool:
            pool.close()
        med = {v: statistics.median(r) for v, r in rates.items()}
        summary[clients] = med
        print(f"\n{connection.vendor}, {clients} client(s), tx/s medians:")
        for v in VARIANTS:
            print(f"  {v:<10}{med[v]:>8.0f}   rounds {[round(r) for r in rates[v]]}")
        for k in (1, 5):
            base = clients / med["order"]
            extra_pub = clients / med[f"publish{k}"] - base
            extra_raw = clients / med[f"raw{k}"] - base
            print(
                f"  k={k}: publish adds {extra_pub * 1e3:.3f} ms/tx, raw INSERT adds "
                f"{extra_raw * 1e3:.3f} ms/tx -> ratio {extra_pub / extra_raw:.2f}"
            )
    connections.close_all()
    Order.objects.all().delete()
    OutboxEvent.objects.all().delete()
    if not args.plot:
        return
    from bench.plot import bars

    groups = [f"{c} client(s)" for c in summary]
    bars(
        args.plot,
        f"Publish overhead on {connection.vendor} (tx/s, higher is better)",
        "transactions/s",
        groups,
        {v: [summary[c][v] for c in summary] for v in VARIANTS},
    )


if __name__ == "__main__":
    main()
