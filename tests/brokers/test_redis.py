"""KombuPublisher against the machine's Redis (kombu's redis transport).

Redis has no publisher confirms: a publish that returns without an error counts
as delivered.
"""

from __future__ import annotations

from outbox_app.exceptions import PublisherUnavailable
from outbox_app.publishers.kombu import KombuPublisher

from .conftest import across_aggregates, assert_delivered, body


def test_a_batch_arrives_exactly_once_in_order_with_cloudevents_attributes(
    redis, redis_url, unique, publishers
):
    queue = redis.bind(unique, unique, "#")
    other = redis.bind(f"{unique}.customers", unique, "shop.Customer.*")
    sent = across_aggregates(50)
    sender = KombuPublisher("redis", {"URL": redis_url, "EXCHANGE": unique})
    publishers.append(sender)

    assert sender.send_batch(sent) == [None] * 50

    received = redis.drain(queue)
    assert [m.properties["message_id"] for m in received] == [
        str(c.event_id) for c in sent
    ]
    for message, ctx in zip(received, sent, strict=True):
        assert_delivered(message, ctx, f"{ctx.aggregate_type}.{ctx.event_type}")
    assert [body(m)["id"] for m in redis.drain(other)] == [
        str(c.event_id) for c in sent if c.aggregate_type == "shop.Customer"
    ]


def test_successive_batches_and_declare(redis, redis_url, unique, publishers):
    redis.delete_later(unique)
    redis.exchange(unique)
    sender = KombuPublisher(
        "redis", {"URL": redis_url, "EXCHANGE": unique, "DECLARE": [unique]}
    )
    publishers.append(sender)
    batches = [across_aggregates(5) for _ in range(3)]

    assert [sender.send_batch(b) for b in batches] == [[None] * 5] * 3

    queue = redis.bind(unique, unique, "#")
    assert [body(m)["id"] for m in redis.drain(queue)] == [
        str(c.event_id) for b in batches for c in b
    ]


def test_an_unreachable_redis_fails_every_message(publishers):
    sender = KombuPublisher(
        "redis", {"URL": "redis://127.0.0.1:1/0", "CONNECT_RETRIES": 0}
    )
    publishers.append(sender)
    outcomes = sender.send_batch(across_aggregates(3))
    assert all(isinstance(o, PublisherUnavailable) for o in outcomes)
    assert all("cannot connect to redis://" in str(o) for o in outcomes), outcomes
    assert "Connection refused" in str(outcomes[0])
