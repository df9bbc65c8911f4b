"""KombuPublisher against the machine's RabbitMQ: confirms, returns, outages.

Every test declares its own uniquely named exchange and queues with an
independent kombu connection before publishing, reads them back, and deletes
them afterwards.
"""

from __future__ import annotations

import datetime
import time
import urllib.parse
from collections import Counter

import pytest

from outbox_app.conf import mask_url
from outbox_app.exceptions import (
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
    UndeliverableMessage,
)
from outbox_app.publishers.kombu import KombuPublisher
from tests.services import RABBITMQ_URL, through

from .conftest import across_aggregates, assert_delivered, body, context


def publisher(publishers, url, **options) -> KombuPublisher:
    built = KombuPublisher("broker", {"URL": url, **options})
    publishers.append(built)
    return built


def test_a_batch_arrives_exactly_once_in_order_with_cloudevents_attributes(
    rabbitmq, rabbitmq_url, unique, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sent = across_aggregates(50)

    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(sent)

    assert outcomes == [None] * 50
    received = rabbitmq.drain(queue)
    assert [m.properties["message_id"] for m in received] == [
        str(c.event_id) for c in sent
    ]
    for message, ctx in zip(received, sent, strict=True):
        assert_delivered(message, ctx, f"{ctx.aggregate_type}.{ctx.event_type}")
        assert message.properties["delivery_mode"] == 2  # persistent
        assert message.properties["type"] == ctx.event_type


def test_routing_keys_follow_the_template_and_topic_bindings(
    rabbitmq, rabbitmq_url, unique, publishers
):
    orders = rabbitmq.bind(f"{unique}.orders", unique, "shop.Order.#")
    customer_7 = rabbitmq.bind(f"{unique}.c7", unique, "*.*.7")
    sent = across_aggregates(20)

    outcomes = publisher(
        publishers,
        rabbitmq_url,
        EXCHANGE=unique,
        ROUTING_KEY="{aggregate_type}.{aggregate_id}",
    ).send_batch([c for c in sent if c.aggregate_id in ("1", "2", "3", "7")])

    assert outcomes == [None] * 16
    assert [body(m)["id"] for m in rabbitmq.drain(orders)] == [
        str(c.event_id) for c in sent if c.aggregate_type == "shop.Order"
    ]
    received = rabbitmq.drain(customer_7)
    assert [body(m)["id"] for m in received] == [
        str(c.event_id) for c in sent if c.aggregate_id == "7"
    ]
    assert {m.delivery_info["routing_key"] for m in received} == {"shop.Customer.7"}


def test_declare_option_creates_a_bound_durable_queue(
    rabbitmq, rabbitmq_url, unique, publishers
):
    rabbitmq.delete_later(unique)
    rabbitmq.exchange(unique)
    sent = across_aggregates(5)
    outcomes = publisher(
        publishers, rabbitmq_url, EXCHANGE=unique, DECLARE=[unique]
    ).send_batch(sent)

    assert outcomes == [None] * 5
    # The publisher's declaration; declaring it again would clash if it differed.
    queue = rabbitmq.bind(unique, unique, "#", expires=False)
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for c in sent
    ]


def test_unroutable_messages_fail_and_the_others_are_delivered(
    rabbitmq, rabbitmq_url, unique, publishers
):
    queue = rabbitmq.bind(unique, unique, "shop.Order.#")
    sent = across_aggregates(10)  # shop.Customer events have no queue

    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(sent)

    for ctx, outcome in zip(sent, outcomes, strict=True):
        if ctx.aggregate_type == "shop.Order":
            assert outcome is None
        else:
            assert isinstance(outcome, MessageUnroutable)
            assert "unroutable" in str(outcome)
            assert "NO_ROUTE" in str(outcome)
            assert f"'shop.Customer.{ctx.event_type}'" in str(outcome)
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for c in sent if c.aggregate_type == "shop.Order"
    ]


def test_an_exchange_without_any_queue_fails_every_message(
    rabbitmq, rabbitmq_url, unique, publishers
):
    rabbitmq.exchange(unique)  # deleted afterwards
    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(
        across_aggregates(3)
    )
    assert all(isinstance(o, MessageUnroutable) for o in outcomes), outcomes


def test_messages_the_broker_nacks_fail(rabbitmq, rabbitmq_url, unique, publishers):
    # A full queue that rejects publishes makes RabbitMQ answer basic.nack.
    queue = rabbitmq.bind(
        unique,
        unique,
        "#",
        arguments={"x-max-length": 3, "x-overflow": "reject-publish"},
    )
    sent = across_aggregates(5)

    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(sent)

    assert outcomes[:3] == [None] * 3
    assert all("basic.nack" in str(o) for o in outcomes[3:]), outcomes
    assert all(isinstance(o, MessageRejected) for o in outcomes[3:]), outcomes
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for c in sent[:3]
    ]


def test_messages_that_cannot_be_encoded_fail_alone(
    rabbitmq, rabbitmq_url, unique, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sent = across_aggregates(3)
    sent[1] = context(1, payload={"when": object()})

    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(sent)

    assert outcomes[0] is None and outcomes[2] is None
    assert isinstance(outcomes[1], UndeliverableMessage)  # expires at once
    assert "cannot encode" in str(outcomes[1])
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(sent[0].event_id),
        str(sent[2].event_id),
    ]


#: Bodies over this many bytes RabbitMQ never takes: its largest
#: ``max_message_size`` default (128 MiB in 3.x; 16 MiB from 4.0).
BROKER_LIMIT = 128 * 2**20


def test_a_type_over_255_utf8_bytes_fails_alone_on_one_connection(
    rabbitmq, unique, proxy, publishers
):
    """An event type of 200 characters is 400 UTF-8 bytes: more than the AMQP
    ``type`` property (a short string) holds. That message can never be
    sent; the rest of its batch and the next batch go out on the same
    connection."""
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique, ROUTING_KEY="{aggregate_type}")
    sent = across_aggregates(5)
    sent[2] = context(2, event_type="é" * 200)

    outcomes = sender.send_batch(sent)

    assert isinstance(outcomes[2], UndeliverableMessage), outcomes
    assert "'type' is 400 bytes" in str(outcomes[2])
    assert outcomes[:2] + outcomes[3:] == [None] * 4
    again = across_aggregates(3)
    assert sender.send_batch(again) == [None] * 3
    assert proxy.connections == 1
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for c in sent[:2] + sent[3:] + again
    ]


@pytest.mark.slow
def test_a_body_over_the_brokers_limit_fails_alone(rabbitmq, unique, proxy, publishers):
    """RabbitMQ closes the channel of a message over its ``max_message_size``
    (406 PRECONDITION_FAILED): that message can never be sent, the others of
    its batch (and of the batch sent after it) are sent again at once, and the
    publisher refuses the next such body itself."""
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique)
    big = context(1, payload={"blob": "x" * (BROKER_LIMIT + 1)})
    first = [*across_aggregates(3), big, *across_aggregates(2)]
    second = across_aggregates(4)

    window = sender.send(first)
    after = sender.send(second)  # the relay's confirm window: on the wire too
    outcomes = sender.collect(window)

    assert isinstance(outcomes[3], UndeliverableMessage), outcomes
    assert "larger than" in str(outcomes[3]) and "max size" in str(outcomes[3])
    assert outcomes[:3] + outcomes[4:] == [None] * 5
    assert sender.collect(after) == [None] * 4
    ids = [body(m)["id"] for m in rabbitmq.drain(queue)]
    expected = [str(c.event_id) for c in first + second if c is not big]
    assert sorted(set(ids)) == sorted(expected)  # the unconfirmed: maybe twice
    # Learned: the next one is refused before it is sent.
    connections = proxy.connections
    outcomes = sender.send_batch([big, *across_aggregates(1)])
    assert isinstance(outcomes[0], UndeliverableMessage) and outcomes[1] is None
    assert "the broker takes at most" in str(outcomes[0])
    assert proxy.connections == connections


def test_successive_batches_reuse_one_connection(
    rabbitmq, rabbitmq_url, unique, proxy, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    url = through(RABBITMQ_URL, proxy.port)
    sender = publisher(publishers, url, EXCHANGE=unique)
    batches = [across_aggregates(7) for _ in range(3)]

    assert [sender.send_batch(b) for b in batches] == [[None] * 7] * 3

    assert proxy.connections == 1
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for batch in batches for c in batch
    ]


# --- the broker going away -------------------------------------------------------


def proxied(publishers, proxy, unique, **options) -> KombuPublisher:
    url = through(RABBITMQ_URL, proxy.port)
    return publisher(publishers, url, EXCHANGE=unique, CONNECT_RETRIES=0, **options)


def test_outage_fails_every_message_with_the_reason_then_recovers(
    rabbitmq, unique, proxy, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique)
    assert sender.send_batch(across_aggregates(2)) == [None, None]
    rabbitmq.drain(queue)

    proxy.cut()
    sent = across_aggregates(20)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    masked = mask_url(through(RABBITMQ_URL, proxy.port))
    assert all(f"cannot connect to {masked}" in str(o) for o in outcomes)
    password = urllib.parse.urlsplit(RABBITMQ_URL).password
    assert f":{password}@" not in str(outcomes[0])  # the password stays out of logs
    assert rabbitmq.drain(queue) == []

    proxy.restore()
    assert sender.send_batch(sent) == [None] * 20
    assert [body(m)["id"] for m in rabbitmq.drain(queue)] == [
        str(c.event_id) for c in sent
    ]


def test_a_connection_dropped_between_batches_is_replaced_without_failing(
    rabbitmq, unique, proxy, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique)
    assert sender.send_batch(across_aggregates(2)) == [None, None]

    proxy.cut()  # e.g. RabbitMQ restarted while the relay was idle
    proxy.restore()
    sent = across_aggregates(10)

    assert sender.send_batch(sent) == [None] * 10
    assert proxy.connections == 2
    assert [body(m)["id"] for m in rabbitmq.drain(queue)][2:] == [
        str(c.event_id) for c in sent
    ]


def test_a_connection_lost_mid_batch_fails_every_unconfirmed_message(
    rabbitmq, unique, proxy, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique)
    assert sender.send_batch(across_aggregates(2)) == [None, None]
    rabbitmq.drain(queue)

    proxy.freeze()  # no confirm can come back ...
    proxy.cut_on_next_send()  # ... and the connection dies once publishing starts
    sent = across_aggregates(50)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert all("lost before the broker confirmed" in str(o) for o in outcomes)

    proxy.restore()
    proxy.thaw()
    assert sender.send_batch(sent) == [None] * 50
    # At least once: what reached the queue before the cut arrives again.
    received = Counter(body(m)["id"] for m in rabbitmq.drain(queue))
    assert set(received) == {str(c.event_id) for c in sent}
    assert max(received.values()) <= 2


def test_a_missing_confirm_times_out_and_fails_the_batch(
    rabbitmq, unique, proxy, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    sender = proxied(publishers, proxy, unique, CONFIRM_TIMEOUT=0.3)
    assert sender.send_batch(across_aggregates(2)) == [None, None]
    rabbitmq.drain(queue)

    proxy.freeze()  # the broker's acks never reach the publisher
    sent = across_aggregates(10)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert all("no publisher confirm" in str(o) and "0.3 s" in str(o) for o in outcomes)

    proxy.thaw()
    assert sender.send_batch(sent) == [None] * 10  # on a new connection
    assert proxy.connections == 2
    received = Counter(body(m)["id"] for m in rabbitmq.drain(queue))
    assert set(received) == {str(c.event_id) for c in sent}
    assert max(received.values()) <= 2


@pytest.mark.parametrize("batch", [1, 500])
def test_batch_sizes(rabbitmq, rabbitmq_url, unique, publishers, batch):
    queue = rabbitmq.bind(unique, unique, "#")
    sent = across_aggregates(batch)
    assert (
        publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(sent)
        == [None] * batch
    )
    assert len(rabbitmq.drain(queue)) == batch


def test_an_empty_batch_does_not_connect(publishers):
    sender = publisher(publishers, "amqp://guest:guest@127.0.0.1:1//")
    assert sender.send_batch([]) == []


def test_an_expiring_event_carries_its_time_left_and_rabbitmq_drops_it_after(
    rabbitmq, rabbitmq_url, unique, publishers
):
    queue = rabbitmq.bind(unique, unique, "#")
    now = datetime.datetime.now(datetime.UTC)
    lasting = context(1, expires_at=now + datetime.timedelta(hours=1))
    brief = context(2, expires_at=now + datetime.timedelta(milliseconds=300))
    plain = context(3)

    outcomes = publisher(publishers, rabbitmq_url, EXCHANGE=unique).send_batch(
        [lasting, brief, plain]
    )

    assert outcomes == [None] * 3
    time.sleep(1)  # the brief one's 300 ms run out in the queue
    received = rabbitmq.drain(queue)
    assert [body(m)["id"] for m in received] == [
        str(lasting.event_id),
        str(plain.event_id),
    ]
    expiration = received[0].properties["expiration"]
    assert 3_590_000 < int(expiration) <= 3_600_000  # milliseconds left
    assert "expiration" not in received[1].properties
