"""Where should PostgreSQL's NOTIFY go: inside the writer's transaction, or in
its on-commit hook? Measures the writer's cost of each, against a writer that
sends none, in the same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox \\
        .venv/bin/python -m bench.bench_notify [--transactions 2000] [--rounds 3]

Each transaction is what a user's write path does: one ``Order`` insert and one
``publish()``. Rounds interleave the variants so machine noise hits all three.
"""

from __future__ import annotations

import argparse
import decimal
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from outbox_app import publish  # noqa: E402
from outbox_app.publishing.outbox import events_committed  # noqa: E402
from outbox_app.relay.wake import CHANNEL, wake_relays  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402
from tests.testapp.models import Order  # noqa: E402


def write(n: int, notify_inside: bool) -> float:
    started = time.perf_counter()
    for i in range(n):
        with transaction.atomic():
            order = Order.objects.create(reference=f"b{i}", total=decimal.Decimal(i))
            publish(OrderPlaced(order_id=order.pk, total=order.total), aggregate=order)
            if notify_inside:
                with connection.cursor() as cursor:
                    cursor.execute(f"NOTIFY {CHANNEL}")
    return n / (time.perf_counter() - started)


def variant(name: str, n: int) -> float:
    events_committed.disconnect(wake_relays, dispatch_uid="outbox_app.wake_relays")
    if name == "on-commit":
        events_committed.connect(wake_relays, dispatch_uid="outbox_app.wake_relays")
    return write(n, notify_inside=name == "inside")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    assert connection.vendor == "postgresql", "NOTIFY is PostgreSQL's"
    call_command("migrate", verbosity=0)
    names = ["none", "on-commit", "inside"]
    results: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            results[name].append(variant(name, args.transactions))
    base = statistics.median(results["none"])
    print(f"{'variant':<12}{'tx/s (median)':>15}{'vs none':>10}")
    for name in names:
        rate = statistics.median(results[name])
        print(f"{name:<12}{rate:>15.0f}{rate / base:>10.2f}x")
    Order.objects.all().delete()
    from outbox_app import OutboxEvent

    OutboxEvent.objects.all().delete()


if __name__ == "__main__":
    main()
