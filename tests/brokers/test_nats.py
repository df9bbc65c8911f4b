"""JetStreamPublisher against the machine's nats-server (JetStream on): PubAcks,
deduplication by ``Nats-Msg-Id``, missing streams, outages; then relays, in
processes killed between publish and mark, and in-process through an outage.

Every test uses its own uniquely named stream and subjects, reads the stream
back with an independent nats-py client, and deletes it afterwards. The
option tests need no server.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import json
import signal
import threading

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, publish
from outbox_app.exceptions import (
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
    UndeliverableMessage,
)
from outbox_app.models import SubscriberPause
from outbox_app.publishers.base import build_publisher
from outbox_app.publishers.nats import JetStreamPublisher
from outbox_app.relay import deliver, relay_once
from outbox_app.store.lifecycle import State
from tests import kit
from tests.kit import delivered
from tests.processes import publisher_relay
from tests.services import NATS_URL, through
from tests.testapp.events import OrderPlaced

from .conftest import across_aggregates, context

BACKEND = "outbox_app.publishers.nats.JetStreamPublisher"
URL = "nats://127.0.0.1:4222"


def publisher(publishers, url, stream, **options) -> JetStreamPublisher:
    built = JetStreamPublisher("bus", {"URL": url, "STREAM": stream, **options})
    publishers.append(built)
    return built


def event_ids(messages) -> list[str]:
    """The event ids of stored messages (the CloudEvents ``id``)."""
    return [json.loads(m.data)["id"] for m in messages]


# --- options (no server) ---------------------------------------------------------


def test_defaults():
    built = build_publisher("bus", {"BACKEND": BACKEND, "URL": URL, "STREAM": "S"})
    assert isinstance(built, JetStreamPublisher)
    assert built.servers == [URL]
    assert built.subject == "outbox.{event_type}"
    assert built.ack_timeout == 10
    assert not built.declare
    assert built.stream_subjects == ["outbox.>"]
    assert built.duplicate_window == 120
    assert built._loop is None  # no thread until the first batch


@pytest.mark.parametrize(
    ("subject", "derived"),
    [
        ("outbox.{event_type}", ["outbox.>"]),
        ("shop.orders.{aggregate_id}.x", ["shop.orders.>"]),
        ("shop.ord{aggregate_id}", ["shop.>"]),
        ("shop.events", ["shop.events"]),
        ("{namespace}.{event_type}", None),
    ],
)
def test_stream_subjects_derive_from_the_subject(subject, derived):
    built = JetStreamPublisher("bus", {"URL": URL, "STREAM": "S", "SUBJECT": subject})
    assert built.stream_subjects == derived


def test_passwords_stay_out_of_messages():
    built = JetStreamPublisher(
        "bus",
        {
            "URL": ["nats://app:secret@n1:4222", "nats://tok@n2", "n3:4222"],
            "STREAM": "S",
        },
    )
    assert built.where == "nats://app:**@n1:4222, nats://**@n2, n3:4222"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"STREAM": "S"}, "'URL' is required"),
        ({"URL": [], "STREAM": "S"}, "'URL' is required"),
        ({"URL": URL}, "'STREAM' is required"),
        ({"URL": URL, "STREAM": "a.b"}, "'STREAM' is required"),
        ({"URL": URL, "STREAM": "S", "SUBJECT": "{aggregate}.x"}, "['aggregate']"),
        ({"URL": URL, "STREAM": "S", "SUBJECT": "{}.x"}, "positional"),
        ({"URL": URL, "STREAM": "S", "SUBJECT": 3}, "'SUBJECT' must be a format"),
        ({"URL": URL, "STREAM": "S", "ACK_TIMEOUT": 0}, "'ACK_TIMEOUT' must be"),
        ({"URL": URL, "STREAM": "S", "ACK_TIMEOUT": True}, "'ACK_TIMEOUT' must be"),
        ({"URL": URL, "STREAM": "S", "DECLARE": "yes"}, "'DECLARE' must be"),
        (
            {"URL": URL, "STREAM": "S", "DUPLICATE_WINDOW": 60},
            "['DUPLICATE_WINDOW'] only apply with 'DECLARE': True",
        ),
        (
            {"URL": URL, "STREAM": "S", "DECLARE": True, "DUPLICATE_WINDOW": "2m"},
            "'DUPLICATE_WINDOW' must be a positive number of seconds",
        ),
        (
            {"URL": URL, "STREAM": "S", "DECLARE": True, "STREAM_SUBJECTS": "a.>"},
            "'STREAM_SUBJECTS' must be a list",
        ),
        (
            {"URL": URL, "STREAM": "S", "DECLARE": True, "SUBJECT": "{namespace}.x"},
            "'STREAM_SUBJECTS' is required with 'DECLARE'",
        ),
        ({"URL": URL, "STREAM": "S", "CONNECT_OPTIONS": []}, "'CONNECT_OPTIONS'"),
        (
            {"URL": URL, "STREAM": "S", "CONNECT_OPTIONS": {"allow_reconnect": True}},
            "may not set ['allow_reconnect']",
        ),
        ({"URL": URL, "STREAM": "S", "ROUTING_KEY": "x"}, "unknown option(s)"),
    ],
)
def test_malformed_options_are_refused(options, message):
    with pytest.raises(ImproperlyConfigured) as raised:
        JetStreamPublisher("bus", options)
    assert "OUTBOX_PUBLISHERS['bus']" in str(raised.value)
    assert message in str(raised.value)


@pytest.mark.parametrize("window, warned", [(60, True), (61, False)])
def test_a_declared_duplicate_window_not_above_the_lease_warns(
    settings, window, warned
):
    from outbox_app.ops.checks import check_subscribers

    settings.OUTBOX_LEASE_SECONDS = 60
    settings.OUTBOX_PUBLISHERS = {
        "bus": {
            "BACKEND": BACKEND,
            "URL": URL,
            "STREAM": "S",
            "DECLARE": True,
            "DUPLICATE_WINDOW": window,
        }
    }
    found = [m for m in check_subscribers() if m.id == "outbox.W005"]
    assert bool(found) == warned
    if warned:
        assert "publisher 'bus': the stream's duplicate window (60 s)" in found[0].msg


def test_an_empty_batch_does_not_connect(publishers):
    sender = publisher(publishers, "nats://127.0.0.1:1", "S")
    assert sender.send_batch([]) == []
    assert sender._loop is None


# --- the publisher against the server ---------------------------------------------


def test_a_batch_is_stored_once_in_order_with_cloudevents_and_the_event_id(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sent = across_aggregates(50)
    subject = unique + ".{aggregate_type}.{event_type}"

    sender = publisher(publishers, nats_url, unique, SUBJECT=subject)
    assert sender.send_batch(sent) == [None] * 50

    stored = jetstream.messages(unique)
    assert event_ids(stored) == [str(c.event_id) for c in sent]
    for message, ctx in zip(stored, sent, strict=True):
        assert message.subject == f"{unique}.{ctx.aggregate_type}.{ctx.event_type}"
        assert message.headers["Content-Type"] == "application/cloudevents+json"
        event = json.loads(message.data)
        assert event["id"] == str(ctx.event_id)
        assert event["specversion"] == "1.0"
        assert event["type"] == ctx.event_type
        assert event["subject"] == ctx.aggregate_id
        assert event["correlationid"] == ctx.headers["correlation_id"]
        assert event["data"] == ctx.payload


def test_a_batch_sent_again_is_acked_and_stored_once(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + ".{event_type}")
    sent = across_aggregates(20)

    assert sender.send_batch(sent) == [None] * 20
    # A relay that crashed before marking sends the same events again: the
    # duplicates are acked (delivered) and dropped by the stream.
    assert sender.send_batch(sent[5:] + across_aggregates(3)) == [None] * 18

    assert jetstream.info(unique).state.messages == 23


def test_two_publishers_into_one_stream_do_not_dedupe_each_other(
    jetstream, nats_url, unique, publishers, settings
):
    """Two entries of one project, or two projects (namespaces), publishing
    the same event ids into one stream: each stores its own copy; each drops
    only its own resend. ``Nats-Msg-Id`` names the namespace, the entry and
    the event."""
    jetstream.create(unique, [f"{unique}.>"])
    subject = unique + ".{event_type}"
    first = publisher(publishers, nats_url, unique, SUBJECT=subject)
    second = JetStreamPublisher(
        "audit", {"URL": nats_url, "STREAM": unique, "SUBJECT": subject}
    )
    publishers.append(second)
    sent = across_aggregates(3)
    elsewhere = [dataclasses.replace(c, namespace="billing") for c in sent]

    assert first.send_batch(sent) == [None] * 3
    assert second.send_batch(sent) == [None] * 3
    assert first.send_batch(elsewhere) == [None] * 3  # another project's
    assert first.send_batch(sent) == [None] * 3  # a resend: dropped

    stored = jetstream.messages(unique)
    assert event_ids(stored) == [str(c.event_id) for c in sent] * 3
    ids = [m.headers["Nats-Msg-Id"] for m in stored]
    assert ids[:3] == [f"shop:bus:{c.event_id}" for c in sent]
    assert ids[3:6] == [f"shop:audit:{c.event_id}" for c in sent]
    assert ids[6:] == [f"billing:bus:{c.event_id}" for c in sent]


def test_message_ids_escape_the_separator():
    sender = JetStreamPublisher("a:b", {"URL": URL, "STREAM": "S"})
    message = context(1, namespace="shop:x")
    _, _, headers = sender._encode(message)
    assert headers["Nats-Msg-Id"] == f"shop%3Ax:a%3Ab:{message.event_id}"


def test_a_stream_whose_duplicate_window_is_short_is_logged_once(
    jetstream, nats_url, unique, publishers, settings, caplog
):
    settings.OUTBOX_LEASE_SECONDS = 60
    jetstream.create(unique, [f"{unique}.>"], duplicate_window=30)
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + ".{event_type}")
    with caplog.at_level("WARNING", logger="outbox_app.relay"):
        assert sender.send_batch(across_aggregates(2)) == [None, None]
        sender.close()  # the next batch connects again
        assert sender.send_batch(across_aggregates(2)) == [None, None]
    [warning] = [r.getMessage() for r in caplog.records]
    assert warning.startswith("publisher bus: the stream's duplicate window (30 s)")


def test_declare_creates_the_stream_then_updates_it(
    jetstream, nats_url, unique, publishers
):
    jetstream.delete_later(unique)
    options = {"SUBJECT": unique + ".{event_type}", "DECLARE": True}
    first = publisher(publishers, nats_url, unique, DUPLICATE_WINDOW=30, **options)
    assert first.send_batch(across_aggregates(2)) == [None, None]
    config = jetstream.info(unique).config
    assert config.subjects == [f"{unique}.>"]
    assert config.duplicate_window == 30

    second = publisher(
        publishers,
        nats_url,
        unique,
        DUPLICATE_WINDOW=600,
        STREAM_SUBJECTS=[f"{unique}-more.>"],
        **options,
    )
    second.probe()
    config = jetstream.info(unique).config
    assert config.subjects == [f"{unique}.>", f"{unique}-more.>"]
    assert config.duplicate_window == 600
    assert jetstream.info(unique).state.messages == 2  # kept


def test_a_subject_no_stream_captures_is_unroutable(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.orders.>"])
    sender = publisher(
        publishers, nats_url, unique, SUBJECT=unique + ".{aggregate_type}.x"
    )
    sent = across_aggregates(5)  # shop.Order and shop.Customer

    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, MessageUnroutable) for o in outcomes), outcomes
    assert f"stream {unique!r}" in str(outcomes[0])
    assert f"'{unique}.shop.Order.x'" in str(outcomes[0])
    assert jetstream.info(unique).state.messages == 0


def test_a_subject_of_another_stream_is_unroutable(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    jetstream.create(f"{unique}-other", [f"{unique}-other.>"])
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + "-other.x")

    [outcome] = sender.send_batch(across_aggregates(1))

    assert isinstance(outcome, MessageUnroutable)
    assert "captured by another stream" in str(outcome)
    assert jetstream.info(f"{unique}-other").state.messages == 0


def test_a_missing_stream_pauses_until_it_exists(
    jetstream, nats_url, unique, publishers
):
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + ".x")
    sent = across_aggregates(3)

    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert f"JetStream stream {unique!r} does not exist" in str(outcomes[0])
    with pytest.raises(PublisherUnavailable, match="does not exist"):
        sender.probe()
    jetstream.create(unique, [f"{unique}.>"])
    sender.probe()
    assert sender.send_batch(sent) == [None] * 3


def test_messages_that_cannot_be_encoded_fail_alone(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = publisher(
        publishers, nats_url, unique, SUBJECT=unique + ".{aggregate_type}.x"
    )
    sent = across_aggregates(4)
    sent[1] = context(1, aggregate_type=None)  # an empty subject token
    sent[2] = context(2, payload={"when": object()})

    outcomes = sender.send_batch(sent)

    assert outcomes[0] is None and outcomes[3] is None
    assert isinstance(outcomes[1], UndeliverableMessage)
    assert "not a subject to publish to" in str(outcomes[1])
    assert isinstance(outcomes[2], UndeliverableMessage)
    assert event_ids(jetstream.messages(unique)) == [
        str(sent[0].event_id),
        str(sent[3].event_id),
    ]


def test_a_message_over_the_servers_max_payload_fails_alone(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + ".x")
    sent = across_aggregates(4)
    sent[1] = context(1, payload={"blob": "x" * 1_048_576})  # max_payload: 1 MiB

    outcomes = sender.send_batch(sent)

    assert isinstance(outcomes[1], UndeliverableMessage), outcomes
    assert "maximum payload exceeded" in str(outcomes[1]).lower(), outcomes[1]
    assert outcomes[:1] + outcomes[2:] == [None] * 3
    assert event_ids(jetstream.messages(unique)) == [
        str(c.event_id) for c in sent[:1] + sent[2:]
    ]


def test_messages_the_stream_refuses_are_rejected(
    jetstream, nats_url, unique, publishers
):
    jetstream.create(unique, [f"{unique}.>"], max_msgs=3, discard="new")
    sender = publisher(publishers, nats_url, unique, SUBJECT=unique + ".x")

    outcomes = sender.send_batch(across_aggregates(5))

    assert outcomes[:3] == [None] * 3
    assert all(isinstance(o, MessageRejected) for o in outcomes[3:]), outcomes
    assert "maximum messages exceeded" in str(outcomes[3])


def test_close_ends_the_loop_thread(jetstream, nats_url, unique):
    jetstream.create(unique, [f"{unique}.>"])
    sender = JetStreamPublisher(
        "bus", {"URL": nats_url, "STREAM": unique, "SUBJECT": unique + ".x"}
    )
    before = threading.active_count()
    assert sender.send_batch(across_aggregates(1)) == [None]
    assert threading.active_count() == before + 1
    sender.close()
    assert threading.active_count() == before
    sender.close()  # twice is fine


# --- the server going away --------------------------------------------------------


def proxied(publishers, proxy, unique, **options) -> JetStreamPublisher:
    url = through(NATS_URL, proxy.port)
    return publisher(publishers, url, unique, SUBJECT=unique + ".x", **options)


def test_outage_fails_every_message_with_the_reason_then_recovers(
    jetstream, unique, nats_proxy, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = proxied(publishers, nats_proxy, unique)
    assert sender.send_batch(across_aggregates(2)) == [None, None]

    nats_proxy.cut()
    sent = across_aggregates(20)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    with pytest.raises(PublisherUnavailable, match="cannot reach"):
        sender.probe()

    nats_proxy.restore()
    sender.probe()
    assert sender.send_batch(sent) == [None] * 20
    assert jetstream.info(unique).state.messages == 22


def test_a_connection_lost_mid_batch_then_resent__stored_once(
    jetstream, unique, nats_proxy, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = proxied(publishers, nats_proxy, unique)
    assert sender.send_batch(across_aggregates(2)) == [None, None]

    nats_proxy.freeze()  # no PubAck can come back ...
    nats_proxy.cut_on_next_send()  # ... and the connection dies once publishing starts
    sent = across_aggregates(50)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert all("lost before the server acknowledged" in str(o) for o in outcomes)

    nats_proxy.restore()
    nats_proxy.thaw()
    assert sender.send_batch(sent) == [None] * 50
    # What reached the stream before the cut is not stored twice.
    assert sorted(event_ids(jetstream.messages(unique))[2:]) == sorted(
        str(c.event_id) for c in sent
    )


def test_a_missing_pub_ack_times_out__resent_and_stored_once(
    jetstream, unique, nats_proxy, publishers
):
    jetstream.create(unique, [f"{unique}.>"])
    sender = proxied(publishers, nats_proxy, unique, ACK_TIMEOUT=0.3)
    assert sender.send_batch(across_aggregates(2)) == [None, None]

    nats_proxy.freeze()  # the server stores the messages; its acks never arrive
    sent = across_aggregates(10)
    outcomes = sender.send_batch(sent)

    assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    assert all("no PubAck" in str(o) and "0.3 s" in str(o) for o in outcomes)

    nats_proxy.thaw()
    assert sender.send_batch(sent) == [None] * 10  # on a new connection
    assert nats_proxy.connections == 2
    assert event_ids(jetstream.messages(unique))[2:] == [str(c.event_id) for c in sent]


# --- relays -------------------------------------------------------------------------


def publish_orders(count: int) -> list:
    with transaction.atomic():
        return publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(count)]
        )


def options(url: str, unique: str, **extra) -> dict:
    return {
        "bus": {
            "BACKEND": BACKEND,
            "URL": url,
            "STREAM": unique,
            "SUBJECT": unique + ".{event_type}",
            **extra,
        }
    }


@pytest.mark.django_db(transaction=True)
def test_a_relay_process_stores_every_committed_event_once(jetstream, nats_url, unique):
    jetstream.create(unique, [f"{unique}.>"])
    rows = publish_orders(300)
    with pytest.raises(RuntimeError), transaction.atomic():
        publish(OrderPlaced(order_id=999, total=decimal.Decimal(1)))
        raise RuntimeError("rolled back: never published")
    delivered(publisher_relay(options(nats_url, unique), batch_size=50), 300)
    stored = jetstream.messages(unique)
    assert sorted(event_ids(stored)) == sorted(str(r.id) for r in rows)
    assert {m.subject for m in stored} == {f"{unique}.OrderPlaced"}
    assert [m.headers["Nats-Msg-Id"] for m in stored] == [
        f"tests:bus:{i}" for i in event_ids(stored)
    ]
    assert kit.states("bus") == {State.SUCCEEDED: 300}
    assert not Delivery.objects.filter(attempts__gt=1).exists()


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    "point",
    [
        "collect:1:after",  # batch 1 acked, not marked; batch 2 on the wire
        "send:2:after",  # batches 1 and 2 on the wire, nothing collected
    ],
)
def test_sigkill_between_publish_and_mark__a_second_relay_stores_nothing_twice(
    jetstream, nats_url, unique, point
):
    """The one duplicate an outbox cannot avoid: the relay dies after the
    server stored a batch and before its rows are marked. After the lease a
    second relay sends those rows again; ``Nats-Msg-Id`` keeps the stream at
    one message per event."""
    jetstream.create(unique, [f"{unique}.>"])
    rows = publish_orders(40)
    lease = {"OUTBOX_TEST_LEASE": "2"}
    killed = publisher_relay(
        options(nats_url, unique, BACKEND="tests.testapp.publishers."
                "KillingJetStreamPublisher"),
        batch_size=8,
        OUTBOX_TEST_KILL_AT=point,
        **lease,
    )  # fmt: skip
    try:
        killed.process.wait(60)
    finally:
        code = killed.stop()
    assert code == -signal.SIGKILL, killed.text()[-3000:]
    assert kit.succeeded() == 0  # nothing recorded delivered
    first = event_ids(jetstream.messages(unique))
    assert len(first) in (8, 16)  # stored, never recorded

    delivered(publisher_relay(options(nats_url, unique), batch_size=8, **lease), 40)
    stored = event_ids(jetstream.messages(unique))
    assert sorted(stored) == sorted(str(r.id) for r in rows)  # once each
    # Those were sent again by the second relay (it delivered all 40) and
    # stored once.
    assert stored[: len(first)] == first


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_publishers")
def test_outage__paused_no_attempt_spent_then_resumed_nothing_lost(
    jetstream, nats_proxy, settings, unique, caplog
):
    jetstream.create(unique, [f"{unique}.>"])
    settings.OUTBOX_PUBLISHERS = options(through(NATS_URL, nats_proxy.port), unique)
    nats_proxy.cut()
    rows = publish_orders(5)

    report = relay_once(kind="publisher")

    assert (report.succeeded, report.failed, report.released) == (0, 0, 5)
    assert kit.states("bus") == {State.PENDING: 5}
    assert not Delivery.objects.filter(attempts__gt=0).exists()
    pause = SubscriberPause.objects.paused().get()
    assert pause.subscriber == "bus" and "cannot connect" in pause.reason
    assert len([r for r in caplog.records if "publisher paused" in r.getMessage()]) == 1
    assert deliver(kind="publisher").claimed == 0  # paused: no claims
    assert jetstream.info(unique).state.messages == 0

    nats_proxy.restore()
    later = timezone.now() + datetime.timedelta(seconds=60)
    assert deliver(kind="publisher", now=later).succeeded == 5
    assert not SubscriberPause.objects.paused().exists()
    assert any("publisher resumed" in r.getMessage() for r in caplog.records)
    assert sorted(event_ids(jetstream.messages(unique))) == sorted(
        str(r.id) for r in rows
    )
    assert kit.states("bus") == {State.SUCCEEDED: 5}
    assert not Delivery.objects.filter(attempts__gt=1).exists()
