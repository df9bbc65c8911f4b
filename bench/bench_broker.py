"""Benchmark 2: the relay draining pending events into RabbitMQ with publisher
confirms, against a raw publish of the same messages in the same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_broker [--events 100000] [--rounds 3]

Per round, interleaved:

* **raw py-amqp**: the events' CloudEvents bodies, encoded beforehand, published
  on one py-amqp channel in confirm mode with up to 1,000 messages in flight
  (the window refills as acks arrive); no database at all;
* **raw pika**: the same with pika's asynchronous ``SelectConnection`` and
  ``confirm_delivery`` (the fastest client measured on this machine kind);
* **outbox_app**: ``deliver()`` of a ``KombuPublisher`` over the same number of
  events, published after the publisher was recorded, with the default
  delivery engine (stream on PostgreSQL and SQLite: its cursor reads them,
  encode, publish, wait for the confirms, move the cursor; no delivery row),
  until none is due;
* **row delivery**: the same with ``OUTBOX_ENGINE = "rows"`` over fanned-out
  PENDING deliveries: claim, read, encode, publish, wait for the confirms,
  mark SUCCEEDED; the next batch is claimed on a second connection while this
  one is published;
* **row delivery, without claim-ahead**: the same,
  ``deliver(claim_ahead=False)``: one batch at a time on one connection.

Every message is persistent, goes to a durable topic exchange bound to one
durable queue (purged between runs), and counts only once the broker acked it.
Prints events/s (median over rounds) and the ratio to the faster raw client;
``--plot NAME`` saves bench/NAME.png.
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

from bench import (  # noqa: E402
    clear,
    context_for,
    engine,
    rabbit,
    record,
    summarize,
    vacuum,
)
from outbox_app import Delivery, OutboxEvent, publish  # noqa: E402
from outbox_app.publishers.kombu import KombuPublisher  # noqa: E402
from outbox_app.relay import deliver, fan_out  # noqa: E402
from outbox_app.store.lifecycle import State  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402

EXCHANGE = QUEUE = "outbox-bench-broker"


def prepare(events: int, publisher: KombuPublisher) -> list[rabbit.Message]:
    """Record ``publisher``, commit ``events`` events, fan them out (row
    delivery; nothing to do with stream delivery); return their encoded
    messages."""
    clear()
    record(publisher)
    for start in range(0, events, 1000):
        with transaction.atomic():
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i))
                    for i in range(start, min(events, start + 1000))
                ],
                aggregate=("testapp.Order", start),
            )
    vacuum()
    fan_out(subscribers=[publisher], batch_size=1000)
    vacuum()
    return [
        rabbit.encode(context_for(event, subscriber=publisher.name))
        for event in OutboxEvent.objects.iterator(chunk_size=2000)
    ]


def undeliver() -> None:
    """Every delivery PENDING again, as fan-out left it (row delivery)."""
    Delivery.objects.update(
        state=State.PENDING,
        attempts=0,
        next_retry_at=timezone.now(),
        completed_at=None,
        locked_until=None,
        lease_token=None,
    )
    vacuum()


def purge() -> None:
    """Declare the exchange and queue (as the publisher's DECLARE does); empty it."""
    rabbit.declare(EXCHANGE, QUEUE)


def outbox(
    events: int, publisher: KombuPublisher, batch_size: int, claim_ahead: bool = True
) -> float:
    purge()
    started = time.perf_counter()
    report = deliver([publisher], batch_size=batch_size, claim_ahead=claim_ahead)
    elapsed = time.perf_counter() - started
    assert report.succeeded == events, report
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    publisher = KombuPublisher(
        "bench-broker", {"URL": rabbit.URL, "EXCHANGE": EXCHANGE, "DECLARE": [QUEUE]}
    )
    rates: dict[str, list[float]] = {
        "raw py-amqp": [],
        "raw pika": [],
        "row delivery, without claim-ahead": [],
        "row delivery": [],
        "outbox_app": [],
    }
    for round_ in range(args.rounds):
        with override_settings(OUTBOX_ENGINE="rows"):
            messages = prepare(args.events, publisher)
            rates["row delivery, without claim-ahead"].append(
                outbox(args.events, publisher, args.batch_size, claim_ahead=False)
            )
            undeliver()
            rates["row delivery"].append(
                outbox(args.events, publisher, args.batch_size)
            )
        prepare(args.events, publisher)
        rates["outbox_app"].append(outbox(args.events, publisher, args.batch_size))
        purge()
        rates["raw py-amqp"].append(rabbit.raw_amqp(messages, EXCHANGE))
        purge()
        rates["raw pika"].append(rabbit.raw_pika(messages, EXCHANGE))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
            flush=True,
        )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    base = max(medians["raw py-amqp"], medians["raw pika"])
    print(
        f"database: {connection.vendor}, {args.events} events, {args.rounds} rounds, "
        f"batch size {args.batch_size}, confirm window {rabbit.WINDOW}; "
        f"outbox_app: {engine()} delivery"
    )
    summarize(
        medians,
        base,
        column="publisher (ratio: to the faster raw client)",
        unit="events/s",
        title=f"{args.events:,} events to RabbitMQ with confirms ({connection.vendor})",
        plot=args.plot,
    )
    clear()
    rabbit.delete(EXCHANGE, QUEUE)
    publisher.close()


if __name__ == "__main__":
    main()
