"""RabbitMQ for the benchmarks: the test queue, and the raw-client baselines.

The baselines publish messages encoded beforehand (no database, no outbox
code on the clock) the way a hand-written fast publisher would: one channel in
confirm mode, up to :data:`WINDOW` messages in flight, the window refilled as
acks arrive; persistent messages, ``mandatory``, to a durable topic exchange
bound to one durable queue with ``#``. Each returns messages/s, counting a
message only once the broker acked it.
"""

from __future__ import annotations

import json
import time
from typing import NamedTuple

import amqp
import pika

from outbox_app.publishers.cloudevents import CONTENT_TYPE, to_cloudevent

URL = "amqp://guest:guest@127.0.0.1:5672//"
HOST, PORT = "127.0.0.1", 5672
#: Messages in flight (published, not yet confirmed) in the raw baselines.
WINDOW = 1000


class Message(NamedTuple):
    body: bytes
    message_id: str
    routing_key: str
    event_type: str


def encode(context) -> Message:
    """What ``KombuPublisher`` sends for a ``DeliveryContext`` with its
    default routing key ``{aggregate_type}.{event_type}``: the CloudEvents
    JSON envelope, the event id as message id."""
    body = json.dumps(
        to_cloudevent(context), ensure_ascii=False, separators=(",", ":")
    ).encode()
    key = f"{context.aggregate_type or ''}.{context.event_type}"
    return Message(body, str(context.event_id), key, context.event_type)


def declare(exchange: str, queue: str, *, purge: bool = True) -> None:
    """Declare the exchange and queue as ``KombuPublisher``'s ``DECLARE`` does
    (durable, bound with ``#``); empty the queue."""
    with amqp.Connection(f"{HOST}:{PORT}") as conn:
        channel = conn.channel()
        channel.exchange_declare(exchange, "topic", durable=True, auto_delete=False)
        channel.queue_declare(queue, durable=True, auto_delete=False)
        channel.queue_bind(queue, exchange, "#")
        if purge:
            channel.queue_purge(queue)


def count(queue: str) -> int:
    """Messages ready in ``queue``."""
    with amqp.Connection(f"{HOST}:{PORT}") as conn:
        return conn.channel().queue_declare(queue, passive=True).message_count


def delete(exchange: str, queue: str) -> None:
    with amqp.Connection(f"{HOST}:{PORT}") as conn:
        channel = conn.channel()
        channel.queue_delete(queue)
        channel.exchange_delete(exchange)


def raw_amqp(messages: list[Message], exchange: str) -> float:
    """py-amqp, one confirm-mode channel, :data:`WINDOW` in flight."""
    conn = amqp.Connection(f"{HOST}:{PORT}")
    conn.connect()
    channel = conn.channel()
    channel.confirm_select()
    acked = 0

    def on_ack(tag, multiple):
        nonlocal acked
        acked = tag  # tags count 1, 2, 3, ...; acks arrive in order here

    channel.events["basic_ack"].add(on_ack)
    started = time.perf_counter()
    for sent, message in enumerate(messages, 1):
        channel.basic_publish(
            amqp.Message(
                message.body,
                content_type=CONTENT_TYPE,
                content_encoding="utf-8",
                delivery_mode=2,
                message_id=message.message_id,
                type=message.event_type,
            ),
            exchange=exchange,
            routing_key=message.routing_key,
            mandatory=True,
        )
        while sent - acked >= WINDOW:
            conn.drain_events(timeout=10)
    while acked < len(messages):
        conn.drain_events(timeout=10)
    elapsed = time.perf_counter() - started
    conn.close()
    return len(messages) / elapsed


def raw_pika(messages: list[Message], exchange: str) -> float:
    """pika's asynchronous ``SelectConnection`` with ``confirm_delivery``,
    :data:`WINDOW` in flight (the fastest client measured on this machine)."""
    state = {"sent": 0, "acked": 0, "started": 0.0, "elapsed": 0.0}
    properties = [
        pika.BasicProperties(
            content_type=CONTENT_TYPE,
            content_encoding="utf-8",
            delivery_mode=2,
            message_id=m.message_id,
            type=m.event_type,
        )
        for m in messages
    ]

    def fill(channel):
        while state["sent"] < len(messages) and state["sent"] - state["acked"] < WINDOW:
            message = messages[state["sent"]]
            channel.basic_publish(
                exchange,
                message.routing_key,
                message.body,
                properties[state["sent"]],
                mandatory=True,
            )
            state["sent"] += 1

    def on_confirm(frame, channel=None):
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            raise RuntimeError("nack")
        state["acked"] = method.delivery_tag
        if state["acked"] >= len(messages):
            state["elapsed"] = time.perf_counter() - state["started"]
            connection.close()
        else:
            fill(channels[0])

    channels: list = []

    def on_channel(channel):
        channels.append(channel)

        def on_select(_frame):
            state["started"] = time.perf_counter()
            fill(channel)

        channel.confirm_delivery(on_confirm, callback=on_select)

    def on_open_error(connection, error):
        connection.ioloop.stop()
        raise RuntimeError(f"pika could not connect: {error}")

    connection = pika.SelectConnection(
        # pika reads the vhost of "amqp://...//" as "", not "/": its defaults
        # (guest on 127.0.0.1:5672, vhost "/") are the same broker as URL.
        pika.ConnectionParameters(HOST, PORT),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_open_error_callback=on_open_error,
        on_close_callback=lambda connection, reason: connection.ioloop.stop(),
    )
    connection.ioloop.start()
    return len(messages) / state["elapsed"]


def confirm_latency(message: Message, exchange: str, count: int, rate: float) -> list:
    """The broker's own share of commit -> confirm: milliseconds from publishing
    one persistent message on a confirm-mode py-amqp channel to its
    ``basic.ack``, ``count`` times at ``rate`` per second, sorted."""
    with amqp.Connection(f"{HOST}:{PORT}") as conn:
        channel = conn.channel()
        channel.confirm_select()
        acked: list[float] = []
        channel.events["basic_ack"].add(lambda tag, multiple: acked.append(1))
        result = []
        for i in range(count):
            began = time.perf_counter()
            channel.basic_publish(
                amqp.Message(
                    message.body,
                    content_type=CONTENT_TYPE,
                    delivery_mode=2,
                    message_id=message.message_id,
                ),
                exchange=exchange,
                routing_key=message.routing_key,
                mandatory=True,
            )
            while len(acked) <= i:
                conn.drain_events(timeout=10)
            result.append((time.perf_counter() - began) * 1000)
            time.sleep(max(0.0, 1 / rate - (time.perf_counter() - began)))
    return sorted(result)
