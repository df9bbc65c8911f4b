"""The transactional inbox's cost: ``manage.py consume`` against a plain kombu
consumer that acknowledges the same messages with no database work, in the
same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_consume [--messages 20000] [--rounds 3]

Each round puts ``--messages`` OrderPlaced CloudEvents (as the RabbitMQ
publisher sends them: persistent, one per event id) in a durable queue bound
to the exchange ``outbox-bench-consume``, then drains it:

* **plain kombu**: a ``kombu.Consumer`` with ``on_message`` that acks each
  message, prefetch 100 (the same window), in this process: messages/s from
  its first read to the last ack;
* **consume, prefetch P**: the real ``python -m django consume`` process of a
  fresh project with default settings (``bench/settings.py``; ``--prefetch``
  only where P is not the default), one no-op ``@consumer``
  (``bench/benchapp/consumers.py``), timed from spawn (process start
  included) until the inbox holds a HANDLED row for every message, then
  stopped with SIGTERM. For each P of ``--prefetch`` (default 1, 10, 100,
  500): how the default ``OUTBOX_INBOX_PREFETCH`` was chosen.

The inbox table is emptied before each run. RabbitMQ at 127.0.0.1:5672
(guest/guest).
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import statistics
import subprocess
import sys
import time
import uuid

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402
from kombu import Connection, Exchange, Producer, Queue  # noqa: E402

from bench import rabbit, summarize  # noqa: E402
from bench.bench_users import ROOT, VENDOR, child_env  # noqa: E402
from outbox_app import InboxMessage  # noqa: E402
from outbox_app.conf import outbox_settings  # noqa: E402
from outbox_app.publishers.cloudevents import CONTENT_TYPE  # noqa: E402
from outbox_app.subscribers import DeliveryContext  # noqa: E402

EXCHANGE = QUEUE = "outbox-bench-consume"


def messages(count: int) -> list[rabbit.Message]:
    """``count`` OrderPlaced events as the RabbitMQ publisher sends them."""
    now = datetime.datetime.now(datetime.UTC)
    return [
        rabbit.encode(
            DeliveryContext(
                event_id=uuid.uuid4(),
                namespace="shop",
                event_type="OrderPlaced",
                revision=1,
                payload={"order_id": n, "total": "9.99"},
                aggregate_type="bench.Order",
                aggregate_id=str(n),
                aggregate_version=None,
                headers={},
                tenant_id=None,
                action_id=None,
                occurred_at=now,
                attempt=1,
                subscriber="rabbitmq",
                delivery_id=n,
            )
        )
        for n in range(count)
    ]


def fill(batch: list[rabbit.Message]) -> None:
    """The queue, emptied, then holding ``batch``."""
    rabbit.declare(EXCHANGE, QUEUE)
    with Connection(rabbit.URL) as conn:
        producer = Producer(conn.channel(), exchange=Exchange(EXCHANGE, "topic"))
        for message in batch:
            producer.publish(
                message.body,
                routing_key=message.routing_key,
                content_type=CONTENT_TYPE,
                content_encoding="utf-8",
                delivery_mode=2,
                message_id=message.message_id,
            )
    while rabbit.count(QUEUE) < len(batch):
        time.sleep(0.05)


def plain(count: int, prefetch: int = 100) -> float:
    """messages/s of a kombu consumer acking each message, no database."""
    acked = 0
    started = None

    def on_message(message) -> None:
        nonlocal acked, started
        if started is None:
            started = time.perf_counter()
        message.ack()
        acked += 1

    with Connection(rabbit.URL) as conn:
        queue = Queue(QUEUE, Exchange(EXCHANGE, "topic"), routing_key="#", durable=True)
        with conn.Consumer([queue], on_message=on_message, prefetch_count=prefetch):
            while acked < count:
                conn.drain_events(timeout=10)
    return count / (time.perf_counter() - started)


def consume(count: int, prefetch: int) -> float:
    """messages/s of the real consume process, spawn to the last HANDLED row."""
    InboxMessage.objects.all().delete()
    args = [sys.executable, "-m", "django", "consume", "--settings", "bench.settings"]
    if prefetch != outbox_settings.raw("INBOX_PREFETCH"):
        args += ["--prefetch", str(prefetch)]
    env = child_env(
        BENCH_CONSUMER_QUEUE=QUEUE,
        BENCH_INBOX_URL=rabbit.URL,
        BENCH_INBOX_EXCHANGE=EXCHANGE,
    )
    began = time.perf_counter()
    child = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        while InboxMessage.objects.count() < count:
            if child.poll() is not None:
                raise SystemExit(f"consume exited with {child.returncode}")
            time.sleep(0.02)
        elapsed = time.perf_counter() - began
    finally:
        child.send_signal(signal.SIGTERM)
        child.wait(30)
    assert child.returncode == 0, child.returncode
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefetch", type=int, nargs="+", default=[1, 10, 100, 500])
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    batch = messages(args.messages)
    rates: dict[str, list[float]] = {"plain kombu, ack only": []}
    for round_ in range(args.rounds):
        fill(batch)
        rates["plain kombu, ack only"].append(plain(args.messages))
        for prefetch in args.prefetch:
            fill(batch)
            name = f"consume, prefetch {prefetch}"
            rates.setdefault(name, []).append(consume(args.messages, prefetch))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
        )
    rabbit.delete(EXCHANGE, QUEUE)
    InboxMessage.objects.all().delete()
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{VENDOR}, {args.messages:,} messages, {args.rounds} round(s); consume: "
        "the real process with default settings, process start included"
    )
    summarize(
        medians,
        medians["plain kombu, ack only"],
        column="consumer (ratio: to plain kombu)",
        unit="messages/s",
        title=f"consume through the inbox, {args.messages:,} messages ({VENDOR})",
        plot=args.plot,
    )
    connection.close()


if __name__ == "__main__":
    main()
