"""Relay overhead per delivery: outbox_app's batched claim/confirm/mark against
a one-row-per-transaction relay, measured in the same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_relay [--events 5000] [--rounds 3]

Both relays deliver to a publisher that accepts everything at once (no broker),
so the numbers are the database work of claiming and recording deliveries. The
baseline is what most outbox libraries do: per row, a transaction that locks one
due row (``FOR UPDATE SKIP LOCKED LIMIT 1`` where supported), sends it, marks it.

With ``--broker amqp://...`` both relays publish to a real RabbitMQ exchange with
persistent messages and publisher confirms (KombuPublisher; the baseline sends
one message per transaction, so it waits for each confirm).

Row delivery's own figure: both relays run with ``OUTBOX_ENGINE = "rows"``
(one delivery row per event, fanned out beforehand), whatever the default
engine; stream delivery's throughput is ``bench/bench_broker.py``'s and
``bench/bench_handlers.py``'s.
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
from django.test.utils import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import clear, context_for, lock_skipping_locked  # noqa: E402
from outbox_app import Delivery, publish  # noqa: E402
from outbox_app.publishers.base import Publisher  # noqa: E402
from outbox_app.relay import deliver, fan_out  # noqa: E402
from outbox_app.store.lifecycle import State  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402


class NullPublisher(Publisher):
    def send_batch(self, messages):
        return [None] * len(messages)


def prepare(events: int, publisher: Publisher) -> None:
    clear()
    for start in range(0, events, 500):
        with transaction.atomic():
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i))
                    for i in range(start, min(events, start + 500))
                ]
            )
    fan_out(subscribers=[publisher], batch_size=500)


def batched(events: int, publisher: Publisher) -> float:
    prepare(events, publisher)
    started = time.perf_counter()
    report = deliver([publisher], batch_size=500)
    elapsed = time.perf_counter() - started
    assert report.succeeded == events, report
    return events / elapsed


def one_row_per_transaction(events: int, publisher: Publisher) -> float:
    prepare(events, publisher)
    due = Delivery.objects.filter(state=State.PENDING).order_by("id")
    started = time.perf_counter()
    done = 0
    while True:
        with transaction.atomic():
            row = lock_skipping_locked(due.select_related("event")).first()
            if row is None:
                break
            outcome = publisher.send_batch([context_for(row.event, row)])
            assert outcome == [None], outcome
            Delivery.objects.filter(id=row.id).update(
                state=State.SUCCEEDED, completed_at=timezone.now(), attempts=1
            )
            done += 1
    elapsed = time.perf_counter() - started
    assert done == events
    return events / elapsed


@override_settings(OUTBOX_ENGINE="rows")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--broker", help="kombu URL: publish to a real broker")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    publisher = NullPublisher("bench-null", {})
    if args.broker:
        from outbox_app.publishers.kombu import KombuPublisher

        publisher = KombuPublisher(
            "bench-broker",
            {
                "URL": args.broker,
                "EXCHANGE": "outbox-bench",
                "DECLARE": ["outbox-bench"],
            },
        )
    rates: dict[str, list[float]] = {"one row per transaction": [], "outbox_app": []}
    for _ in range(args.rounds):
        rates["one row per transaction"].append(
            one_row_per_transaction(args.events, publisher)
        )
        rates["outbox_app"].append(batched(args.events, publisher))
    base = statistics.median(rates["one row per transaction"])
    print(
        f"database: {connection.vendor}, {args.events} events, {args.rounds} rounds, "
        f"publisher: {args.broker or 'none (accepts at once)'}, row delivery"
    )
    print(f"{'relay':<26}{'deliveries/s (median)':>24}{'vs baseline':>13}")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"{name:<26}{rate:>24.0f}{rate / base:>12.1f}x")
    clear()
    if args.broker:
        with publisher._connection.channel() as channel:
            channel.queue_delete("outbox-bench")
            channel.exchange_delete("outbox-bench")
        publisher.close()


if __name__ == "__main__":
    main()
