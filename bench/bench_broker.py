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
  fanned-out PENDING notifications: claim, read, encode, publish, wait for the
  confirms, mark SUCCEEDED, until none is due; the next batch is claimed on a
  second connection while this one is published;
* **without claim-ahead**: the same, one batch at a time on one connection.

Every message is persistent, goes to a durable topic exchange bound to one
durable queue (purged between runs), and counts only once the broker acked it.
Prints events/s (median over rounds) and the ratio to the faster raw client;
``--plot NAME`` saves bench/NAME.png.
"""

from __future__ import annotations

import argparse
import decimal
import json
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

import amqp  # noqa: E402
import pika  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import summarize, vacuum, without_claim_ahead  # noqa: E402
from outbox_app import Notification, OutboxEvent, publish  # noqa: E402
from outbox_app.fanout import fan_out  # noqa: E402
from outbox_app.publishers.cloudevents import CONTENT_TYPE, to_cloudevent  # noqa: E402
from outbox_app.publishers.kombu import KombuPublisher  # noqa: E402
from outbox_app.relay import context_for, deliver  # noqa: E402
from outbox_app.states import State  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402

URL = "amqp://guest:guest@127.0.0.1:5672//"
EXCHANGE = QUEUE = "outbox-bench-broker"
WINDOW = 1000


def prepare(events: int, publisher: KombuPublisher) -> list[tuple[bytes, str, str]]:
    """Commit ``events`` events, fan them out; return their encoded messages."""
    Notification.objects.all().delete()
    OutboxEvent.objects.all().delete()
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
    messages = []
    for row in Notification.objects.select_related("event").iterator(chunk_size=2000):
        context = context_for(row)
        body = json.dumps(
            to_cloudevent(context), ensure_ascii=False, separators=(",", ":")
        ).encode()
        messages.append((body, str(context.event_id), "testapp.Order.OrderPlaced"))
    return messages


def undeliver() -> None:
    """Every notification PENDING again, as fan-out left it."""
    Notification.objects.update(
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
    with amqp.Connection("127.0.0.1:5672") as conn:
        channel = conn.channel()
        channel.exchange_declare(EXCHANGE, "topic", durable=True, auto_delete=False)
        channel.queue_declare(QUEUE, durable=True, auto_delete=False)
        channel.queue_bind(QUEUE, EXCHANGE, "#")
        channel.queue_purge(QUEUE)


def raw_amqp(messages: list[tuple[bytes, str, str]]) -> float:
    purge()
    conn = amqp.Connection("127.0.0.1:5672")
    conn.connect()
    channel = conn.channel()
    channel.confirm_select()
    acked = 0

    def on_ack(tag, multiple):
        nonlocal acked
        acked = tag  # tags count 1, 2, 3, ...; acks arrive in order here

    channel.events["basic_ack"].add(on_ack)
    started = time.perf_counter()
    for sent, (body, message_id, key) in enumerate(messages, 1):
        channel.basic_publish(
            amqp.Message(
                body,
                content_type=CONTENT_TYPE,
                content_encoding="utf-8",
                delivery_mode=2,
                message_id=message_id,
                type="OrderPlaced",
            ),
            exchange=EXCHANGE,
            routing_key=key,
            mandatory=True,
        )
        while sent - acked >= WINDOW:
            conn.drain_events(timeout=10)
    while acked < len(messages):
        conn.drain_events(timeout=10)
    elapsed = time.perf_counter() - started
    conn.close()
    return len(messages) / elapsed


def raw_pika(messages: list[tuple[bytes, str, str]]) -> float:
    purge()
    state = {"sent": 0, "acked": 0, "started": 0.0, "elapsed": 0.0}
    properties = [
        pika.BasicProperties(
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            delivery_mode=2,
            message_id=message_id,
            type="OrderPlaced",
        )
        for _, message_id, _ in messages
    ]

    def fill(channel):
        while state["sent"] < len(messages) and state["sent"] - state["acked"] < WINDOW:
            body, _, key = messages[state["sent"]]
            channel.basic_publish(
                EXCHANGE, key, body, properties[state["sent"]], mandatory=True
            )
            state["sent"] += 1

    def on_confirm(frame, channel=None):
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            raise RuntimeError("nack")
        state["acked"] = method.delivery_tag
        if state["acked"] >= len(messages):
            state["elapsed"] = time.perf_counter() - state["started"]
            connection_.close()
        else:
            fill(channel_[0])

    channel_: list = []

    def on_channel(channel):
        channel_.append(channel)

        def on_select(_frame):
            state["started"] = time.perf_counter()
            fill(channel)

        channel.confirm_delivery(on_confirm, callback=on_select)

    def on_open_error(connection, error):
        connection.ioloop.stop()
        raise RuntimeError(f"pika could not connect: {error}")

    connection_ = pika.SelectConnection(
        # pika reads the vhost of "amqp://...//" as "", not "/": its defaults
        # (guest on 127.0.0.1:5672, vhost "/") are the same broker as URL.
        pika.ConnectionParameters("127.0.0.1", 5672),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=on_open_error,
        on_close_callback=lambda connection, reason: connection.ioloop.stop(),
    )
    connection_.ioloop.start()
    return len(messages) / state["elapsed"]


def outbox(events: int, publisher: KombuPublisher, batch_size: int) -> float:
    purge()
    started = time.perf_counter()
    report = deliver([publisher], batch_size=batch_size)
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
        "bench-broker", {"URL": URL, "EXCHANGE": EXCHANGE, "DECLARE": [QUEUE]}
    )
    rates: dict[str, list[float]] = {
        "raw py-amqp": [],
        "raw pika": [],
        "without claim-ahead": [],
        "outbox_app": [],
    }
    for round_ in range(args.rounds):
        messages = prepare(args.events, publisher)
        with without_claim_ahead():
            rates["without claim-ahead"].append(
                outbox(args.events, publisher, args.batch_size)
            )
        undeliver()
        rates["outbox_app"].append(outbox(args.events, publisher, args.batch_size))
        rates["raw py-amqp"].append(raw_amqp(messages))
        rates["raw pika"].append(raw_pika(messages))
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
            flush=True,
        )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    base = max(medians["raw py-amqp"], medians["raw pika"])
    print(
        f"database: {connection.vendor}, {args.events} events, {args.rounds} rounds, "
        f"batch size {args.batch_size}, confirm window {WINDOW}"
    )
    summarize(
        medians,
        base,
        column="publisher (ratio: to the faster raw client)",
        unit="events/s",
        title=f"{args.events:,} events to RabbitMQ with confirms ({connection.vendor})",
        plot=args.plot,
    )
    Notification.objects.all().delete()
    OutboxEvent.objects.all().delete()
    with amqp.Connection("127.0.0.1:5672") as conn:
        channel = conn.channel()
        channel.queue_delete(QUEUE)
        channel.exchange_delete(EXCHANGE)
    publisher.close()


if __name__ == "__main__":
    main()
