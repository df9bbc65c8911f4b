"""KombuPublisher on kombu's in-memory transport (``memory://``), the embedded
default: same process, no broker."""

from __future__ import annotations

import uuid

from kombu import Connection, Exchange, Queue

from outbox_app.publishers.kombu import KombuPublisher

from .conftest import across_aggregates, assert_delivered, body, context


def test_memory_transport_delivers_in_order(publishers):
    name = f"outbox-test-{uuid.uuid4().hex[:12]}"
    sender = KombuPublisher(
        "memory", {"URL": "memory://", "EXCHANGE": name, "DECLARE": [name]}
    )
    publishers.append(sender)
    sent = across_aggregates(10)
    sent.append(context(10, aggregate_type=None, aggregate_id=None))

    assert sender.send_batch(sent) == [None] * 11

    with Connection("memory://") as connection:
        queue = Queue(name, Exchange(name, "topic", durable=True), "#")(
            connection.default_channel
        )
        received = []
        while (message := queue.get(no_ack=True)) is not None:
            received.append(message)
        queue.delete()
    for message, ctx in zip(received[:10], sent[:10], strict=True):
        assert_delivered(message, ctx, f"{ctx.aggregate_type}.{ctx.event_type}")
    # No aggregate: no subject, no aggregate attributes; the routing key's
    # None fields format as "".
    last = received[10]
    assert "subject" not in body(last) and "aggregatetype" not in body(last)
    assert last.delivery_info["routing_key"] == ".OrderPlaced"
    assert len(received) == 11
