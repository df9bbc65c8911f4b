"""KafkaPublisher against tansu, a Kafka-protocol broker the tests start on a
loopback port (tests/brokers/tansu.py): delivery reports, keys, both wire
formats, records the broker refuses, outages; then relays, in a process through
an outage of the broker (killed and started again) and in-process.

Every test writes to topics of its own and reads them back with a plain
confluent-kafka consumer group. tansu counts batches, not records, in its high
watermarks and joins a group in about half the session timeout, so the
consumer reads until it has been idle a while, with a short
``session.timeout.ms``. The option tests need no broker.
"""

from __future__ import annotations

import datetime
import decimal
import json
import re
import signal
import time
import uuid
from collections import defaultdict

import pytest
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.test import override_settings
from django.utils import timezone

from outbox_app import Delivery, publish
from outbox_app.exceptions import (
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
    UndeliverableMessage,
)
from outbox_app.models import SubscriberPause
from outbox_app.publishers.base import build_publisher, render, template_fields
from outbox_app.publishers.kafka import KafkaPublisher
from outbox_app.relay import deliver
from outbox_app.relay.registry import close_publishers
from outbox_app.store.lifecycle import State
from tests import kit
from tests.kit import delivered
from tests.processes import Watched, publisher_relay, wait_for
from tests.testapp.events import OrderPlaced

from .conftest import across_aggregates, context

BACKEND = "outbox_app.publishers.kafka.KafkaPublisher"
#: The schema tansu validates the records of topic ``<prefix>-strict`` with
#: (``--schema-registry``): a value without a ``nonsense`` field is refused.
STRICT_SCHEMA = {
    "type": "object",
    "properties": {
        "value": {"type": "object", "required": ["nonsense"]},
    },
}


def publisher(publishers, servers, **options) -> KafkaPublisher:
    built = KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": servers, **options})
    publishers.append(built)
    return built


def consume(servers: str, topics: list[str], idle: float = 3.0) -> list:
    """Every record of ``topics``, read by a new consumer group until none
    came for ``idle`` seconds since it joined (at most 60 s): a list of confluent-kafka
    Messages, in the order read (each partition's in offset order)."""
    from confluent_kafka import Consumer

    consumer = Consumer(
        {
            "bootstrap.servers": servers,
            "group.id": f"test-{uuid.uuid4().hex[:12]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "session.timeout.ms": 2000,
            "heartbeat.interval.ms": 300,
            "log_level": 0,
        }
    )
    joined: list[float] = []  # when the group gave it partitions
    consumer.subscribe(topics, on_assign=lambda *_: joined.append(time.monotonic()))
    read: list = []
    started = time.monotonic()
    last = None
    try:
        while time.monotonic() - started < 60:
            if joined and time.monotonic() - max(last or 0, joined[-1]) > idle:
                break
            message = consumer.poll(0.2)
            if message is None:
                continue
            if message.error():
                continue  # _PARTITION_EOF, a topic not created yet
            read.append(message)
            last = time.monotonic()
    finally:
        consumer.close()
    return read


def event_ids(records) -> list[str]:
    return [json.loads(r.value())["id"] for r in records]


# --- options (no broker) -------------------------------------------------------


def test_defaults():
    built = KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": ["k1:9092", "k2:9092"]})
    assert built.servers == "k1:9092,k2:9092"
    assert (built.topic, built.key, built.format) == (
        "{aggregate_type}",
        "{aggregate_id}",
        "cloudevents",
    )
    assert built.config["enable.idempotence"] is True
    assert built.config["acks"] == "all"
    assert built.config["message.timeout.ms"] == 10_000
    assert build_publisher("bus", {"BACKEND": BACKEND, "BOOTSTRAP_SERVERS": "k:1"})


@pytest.mark.services("kafka")  # librdkafka checks CONFIG
@pytest.mark.parametrize(
    "options, message",
    [
        ({"BOOTSTRAP_SERVERS": None}, "'BOOTSTRAP_SERVERS' is required"),
        ({"BOOTSTRAP_SERVERS": ""}, "'BOOTSTRAP_SERVERS' is required"),
        ({"BOOTSTRAP_SERVERS": [""]}, "'BOOTSTRAP_SERVERS' is required"),
        ({"FORMAT": "avro"}, "'FORMAT' must be one of"),
        ({"DELIVERY_TIMEOUT": 0}, "'DELIVERY_TIMEOUT' must be a positive"),
        ({"DELIVERY_TIMEOUT": "10"}, "'DELIVERY_TIMEOUT' must be a positive"),
        ({"TOPIC": "{nope}"}, "unknown field(s) ['nope']"),
        ({"KEY": "{}"}, "positional fields"),
        ({"CONFIG": ["acks"]}, "'CONFIG' must be a dict"),
        ({"CONFIG": {"acks": "1"}}, "'CONFIG' may not set ['acks']"),
        ({"CONFIG": {"enable.idempotence": False}}, "may not set"),
        ({"CONFIG": {"linger.mss": 5}}, "refused by librdkafka"),
        ({"CONFIG": {"max.in.flight": 10}}, "refused by librdkafka"),
        ({"TOPICS": "x"}, "unknown option(s) ['TOPICS']"),
    ],
)
def test_malformed_options_are_refused(options, message):
    with pytest.raises(ImproperlyConfigured, match=re.escape(message)):
        KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": "k:9092", **options})


def test_topics_are_sanitised_to_kafkas_alphabet():
    built = KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": "k:9092"})
    assert built._topic_of("shop.Order") == "shop.Order"
    assert built._topic_of("outbox.event.shop Order/ü") == "outbox.event.shop_Order__"
    for bad in ("", ".", "..", "x" * 250):
        with pytest.raises(ValueError, match="not a Kafka topic name"):
            built._topic_of(bad)


@pytest.mark.parametrize(
    "template",
    [
        "{aggregate_type}",
        "{aggregate_id}",
        "{aggregate_version}",
        "{action_id}",
        "{event_id}",
        "{occurred_at}",
        "{dimension}",
        "{operation}",
        "{headers[correlation_id]}",
        "outbox.event.{aggregate_type}",
    ],
)
@pytest.mark.parametrize("aggregate_id", ["42", None])
def test_topic_and_key_templates_render_as_every_publishers_do(template, aggregate_id):
    built = KafkaPublisher(
        "bus", {"BOOTSTRAP_SERVERS": "k:9092", "TOPIC": template, "KEY": template}
    )
    sent = context(7, aggregate_id=aggregate_id, action_id=None)
    expected = render(template, template_fields("bus", "KEY", template), sent)
    assert built._render_topic(sent) == built._render_key(sent) == expected


def _serious(publishers: dict) -> list:
    with override_settings(OUTBOX_PUBLISHERS=publishers):
        close_publishers()
        return [
            m
            for m in checks.run_checks(include_deployment_checks=False)
            if m.id.startswith("outbox.")
        ]


def test_check_refuses_bad_options():
    found = _serious({"bus": {"BACKEND": BACKEND, "FORMAT": "avro"}})
    assert [m.id for m in found] == ["outbox.E015"]
    assert "'BOOTSTRAP_SERVERS' is required" in found[0].msg


def test_check_warns_without_confluent_kafka(monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "confluent_kafka", None)
    found = _serious({"bus": {"BACKEND": BACKEND, "BOOTSTRAP_SERVERS": "k:9092"}})
    assert [m.id for m in found] == ["outbox.W007"]
    assert "pip install 'outbox_app[kafka]'" in found[0].msg
    built = KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": "k:9092"})
    outcomes = built.send_batch(across_aggregates(2))
    assert all(isinstance(o, PublisherUnavailable) for o in outcomes)
    assert "pip install 'outbox_app[kafka]'" in str(outcomes[0])
    with pytest.raises(PublisherUnavailable, match=re.escape("pip install")):
        built.probe()


@pytest.mark.services("kafka")  # confluent-kafka's errors
@pytest.mark.parametrize(
    "code, outcome",
    [
        ("MSG_SIZE_TOO_LARGE", UndeliverableMessage),
        ("TOPIC_EXCEPTION", UndeliverableMessage),
        ("UNKNOWN_TOPIC_OR_PART", MessageUnroutable),
        ("_UNKNOWN_TOPIC", MessageUnroutable),
        ("TOPIC_AUTHORIZATION_FAILED", MessageRejected),
        ("INVALID_RECORD", MessageRejected),
        ("_MSG_TIMED_OUT", PublisherUnavailable),
        ("_PURGE_INFLIGHT", PublisherUnavailable),
        ("NOT_ENOUGH_REPLICAS", PublisherUnavailable),  # retriable
    ],
)
def test_a_delivery_reports_error_is_judged_by_its_code(code, outcome):
    from confluent_kafka import KafkaError

    from outbox_app.publishers.kafka import _outcome

    built = KafkaPublisher("bus", {"BOOTSTRAP_SERVERS": "k:9092"})
    error = KafkaError(getattr(KafkaError, code))
    judged = _outcome(built, error)
    assert type(judged) is outcome
    assert str(judged).startswith(f"{code}: ")
    assert _outcome(built, None) is None


# --- against tansu ---------------------------------------------------------------


def test_a_batch_reaches_its_topics_keyed_by_aggregate_in_order(
    publishers, kafka_servers, unique
):
    sender = publisher(publishers, kafka_servers, TOPIC=unique + ".{aggregate_type}")
    sent = across_aggregates(30)
    assert sender.send_batch(sent[:15]) == [None] * 15
    handle = sender.send(sent[15:])  # a window: two batches in flight
    assert sender.send_batch([]) == []
    assert sender.collect(handle) == [None] * 15

    topics = [f"{unique}.shop.Order", f"{unique}.shop.Customer"]
    records = consume(kafka_servers, topics)
    assert sorted(event_ids(records)) == sorted(str(c.event_id) for c in sent)
    by_id = {str(c.event_id): c for c in sent}
    per_key = defaultdict(list)
    for record in records:
        event = json.loads(record.value())
        sent_context = by_id[event["id"]]
        assert record.key() == sent_context.aggregate_id.encode()
        assert record.topic() == f"{unique}.{sent_context.aggregate_type}"
        assert record.headers() == [("content-type", b"application/cloudevents+json")]
        assert event["specversion"] == "1.0"
        assert event["source"] == "shop"
        assert event["type"] == sent_context.event_type
        assert event["subject"] == sent_context.aggregate_id
        assert event["data"] == sent_context.payload
        per_key[record.key()].append(event["aggregateversion"])
    assert set(per_key) == {b"1", b"2", b"3", b"7", b"8"}
    for versions in per_key.values():
        assert versions == sorted(versions)  # publish order within its partition


def test_debezium_format_sends_the_payload_with_id_and_event_type_headers(
    publishers, kafka_servers, unique
):
    sender = publisher(
        publishers,
        kafka_servers,
        TOPIC=unique + ".outbox.event.{aggregate_type}",
        FORMAT="debezium",
    )
    sent = across_aggregates(4)
    assert sender.send_batch(sent) == [None] * 4
    records = consume(
        kafka_servers,
        [f"{unique}.outbox.event.shop.Order", f"{unique}.outbox.event.shop.Customer"],
    )
    by_id = {str(c.event_id): c for c in sent}
    assert len(records) == 4
    for record in records:
        headers = dict(record.headers())
        sent_context = by_id[headers["id"].decode()]
        assert headers["eventType"] == sent_context.event_type.encode()
        assert json.loads(record.value()) == sent_context.payload
        assert record.key() == sent_context.aggregate_id.encode()


def test_an_event_without_aggregate_goes_without_key(publishers, kafka_servers, unique):
    sender = publisher(publishers, kafka_servers, TOPIC=unique)
    assert sender.send_batch([context(1, aggregate_type=None, aggregate_id=None)]) == [
        None
    ]
    [record] = consume(kafka_servers, [unique])
    assert record.key() is None


def test_records_that_cannot_be_sent_are_undeliverable_alone(
    publishers, kafka_servers, unique
):
    sender = publisher(publishers, kafka_servers, TOPIC=unique + "{headers[topic]}")
    sent = [
        context(1, headers={"topic": ""}),
        context(2, headers={"topic": "x" * 250}),  # over 249 characters
        context(3, headers={}),  # the template's header is missing
        context(4, headers={"topic": ""}, payload={"big": "x" * 1_100_000}),
        context(5, headers={"topic": ""}),
    ]
    outcomes = sender.send_batch(sent)
    assert outcomes[0] is None and outcomes[4] is None
    for outcome in outcomes[1:4]:
        assert isinstance(outcome, UndeliverableMessage)
    assert "not a Kafka topic name" in str(outcomes[1])
    assert "MSG_SIZE_TOO_LARGE" in str(outcomes[3])
    assert sorted(event_ids(consume(kafka_servers, [unique]))) == sorted(
        [str(sent[0].event_id), str(sent[4].event_id)]
    )


def strict_tansu(tansu, tmp_path, unique) -> str:
    """Restart ``tansu`` validating topic ``<unique>-strict`` (its records are
    refused); its topic name."""
    (tmp_path / f"{unique}-strict.json").write_text(json.dumps(STRICT_SCHEMA))
    tansu.stop()
    tansu.schemas = tmp_path
    tansu.start()
    return f"{unique}-strict"


def test_a_record_the_broker_refuses_fails_alone_with_the_errors_name(
    publishers, tansu, tmp_path, unique
):
    strict = strict_tansu(tansu, tmp_path, unique)
    sender = publisher(publishers, tansu.servers, TOPIC="{headers[topic]}")
    outcomes = sender.send_batch(
        [context(1, headers={"topic": strict}), context(2, headers={"topic": unique})]
    )
    assert isinstance(outcomes[0], MessageRejected)
    assert str(outcomes[0]).startswith("INVALID_RECORD: ")
    assert outcomes[1] is None


def test_an_unreachable_cluster_is_an_outage_told_fast(publishers, tansu):
    servers = tansu.servers
    tansu.stop()
    sender = publisher(publishers, servers)
    started = time.monotonic()
    outcomes = sender.send_batch(across_aggregates(3))
    assert time.monotonic() - started < 5  # not the 10 s delivery timeout
    assert all(isinstance(o, PublisherUnavailable) for o in outcomes)
    assert "cannot reach the Kafka cluster" in str(outcomes[0])
    with pytest.raises(PublisherUnavailable, match="cannot reach"):
        sender.probe()

    tansu.start()
    sender.probe()
    assert sender.send_batch(across_aggregates(3)) == [None] * 3


def test_a_broker_killed_with_batches_in_flight__a_new_producer_after_it(
    publishers, tansu, unique
):
    """tansu's memory holds the producer ids: a producer of before the crash
    could never write again, so the publisher builds a new one."""
    sender = publisher(publishers, tansu.servers, TOPIC=unique)
    assert sender.send_batch(across_aggregates(2)) == [None] * 2
    first = sender.send(across_aggregates(5))
    second = sender.send(across_aggregates(5))
    before = sender._producer
    tansu.stop()
    for handle in (first, second):
        outcomes = sender.collect(handle)
        assert all(isinstance(o, PublisherUnavailable) for o in outcomes), outcomes
    tansu.start()
    wait_for(lambda: _probes(sender), 30, "the probe to pass")
    sent = across_aggregates(5)
    assert sender.send_batch(sent) == [None] * 5
    assert sender._producer is not before
    assert sorted(event_ids(consume(tansu.servers, [unique]))) == sorted(
        str(c.event_id) for c in sent
    )


def _probes(sender) -> bool:
    try:
        sender.probe()
    except PublisherUnavailable:
        return False
    return True


# --- relays -------------------------------------------------------------------------


def publish_orders(count: int, aggregates: int = 10) -> list:
    with transaction.atomic():
        return [
            publish(
                OrderPlaced(order_id=i, total=decimal.Decimal(i)),
                aggregate=("shop.Order", str(i % aggregates)),
            )[0]
            for i in range(count)
        ]


def options(servers: str, topic: str, **extra) -> dict:
    return {"bus": {"BACKEND": BACKEND, "BOOTSTRAP_SERVERS": servers, "TOPIC": topic}
            | extra}  # fmt: skip


def assert_once_in_order(records, rows) -> None:
    """Each row's event once, keyed by its aggregate id, each aggregate's in
    publish order."""
    ids = event_ids(records)
    assert sorted(ids) == sorted(str(r.id) for r in rows)
    position = {str(r.id): n for n, r in enumerate(rows)}
    aggregate = {str(r.id): r.aggregate_id for r in rows}
    per_key = defaultdict(list)
    for record, event_id in zip(records, ids, strict=True):
        assert record.key() == aggregate[event_id].encode()
        per_key[record.key()].append(position[event_id])
    for positions in per_key.values():
        assert positions == sorted(positions)


def stopped(relay: Watched) -> None:
    code = relay.stop()
    assert code == 0, relay.text()[-3000:]


@pytest.mark.django_db(transaction=True)
def test_a_relay_process_sends_every_committed_event_once_in_order_per_key(
    kafka_servers, unique
):
    rows = publish_orders(300)
    with pytest.raises(RuntimeError), transaction.atomic():
        publish(OrderPlaced(order_id=999, total=decimal.Decimal(1)))
        raise RuntimeError("rolled back: never published")
    relay = publisher_relay(options(kafka_servers, unique), batch_size=50)
    delivered(relay, 300)
    assert_once_in_order(consume(kafka_servers, [unique]), rows)
    assert kit.states("bus") == {State.SUCCEEDED: 300}
    assert not Delivery.objects.filter(attempts__gt=1).exists()


@pytest.mark.django_db(transaction=True)
def test_sigkill_between_report_and_mark__sent_again_never_lost(kafka_servers, unique):
    """A relay killed after the cluster reported batch 1 delivered, before
    its rows were marked: after the lease a second relay sends them again
    (new records: idempotence spans one producer), and nothing is lost."""
    rows = publish_orders(40)
    lease = {"OUTBOX_TEST_LEASE": "2"}
    killing = "tests.testapp.publishers.KillingKafkaPublisher"
    killed = publisher_relay(
        options(kafka_servers, unique, BACKEND=killing),
        batch_size=8,
        OUTBOX_TEST_KILL_AT="collect:1:after",
        **lease,
    )
    try:
        killed.process.wait(60)
    finally:
        code = killed.stop()
    assert code == -signal.SIGKILL, killed.text()[-3000:]
    assert kit.succeeded() == 0  # nothing recorded delivered

    relay = publisher_relay(options(kafka_servers, unique), batch_size=8, **lease)
    delivered(relay, 40)
    received = event_ids(consume(kafka_servers, [unique]))
    assert set(received) == {str(r.id) for r in rows}  # none lost
    twice = [i for i in set(received) if received.count(i) > 1]
    assert 8 <= len(twice) <= 16  # batch 1, and batch 2 if it got there


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_publishers")
def test_failed_reports_are_retried_then_delivered(tansu, tmp_path, unique, settings):
    strict = strict_tansu(tansu, tmp_path, unique)
    settings.OUTBOX_PUBLISHERS = options(tansu.servers, strict)
    rows = publish_orders(6)

    report = deliver(kind="publisher")

    assert (report.succeeded, report.failed) == (0, 6)
    failed = Delivery.objects.get(event_id=rows[0].id)
    assert (failed.state, failed.attempts) == (State.FAILED, 1)
    assert failed.last_error_type == "outbox_app.exceptions.MessageRejected"
    assert failed.last_error.startswith("INVALID_RECORD")

    tansu.stop()  # the schema goes: the topic takes anything
    tansu.schemas = None
    tansu.start()
    later = datetime.timedelta(minutes=5)  # past every backoff and pause
    wait_for(
        lambda: (
            deliver(kind="publisher", now=timezone.now() + later) is not None
            and not Delivery.objects.exclude(state=State.SUCCEEDED).exists()
        ),
        60,
        "the retries to be delivered",
    )
    assert set(Delivery.objects.values_list("attempts", flat=True)) == {2}
    assert sorted(event_ids(consume(tansu.servers, [strict]))) == sorted(
        str(r.id) for r in rows
    )


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("_close_publishers")
def test_an_oversized_record_is_dead_lettered_alone_and_nothing_pauses(
    kafka_servers, unique, settings
):
    settings.OUTBOX_PUBLISHERS = options(
        kafka_servers, unique, CONFIG={"message.max.bytes": 10_000}
    )
    with transaction.atomic():
        small = publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))[0]
        big = publish({"event_type": "BlobStored", "payload": {"blob": "x" * 20_000}})[
            0
        ]
        after = publish(OrderPlaced(order_id=2, total=decimal.Decimal(2)))[0]

    report = deliver(kind="publisher")

    assert (report.succeeded, report.failed, report.dead) == (2, 0, 1)
    dead = Delivery.objects.get(event_id=big.id)
    assert (dead.state, dead.attempts) == (State.DEAD, 1)
    assert dead.last_error_type == "outbox_app.exceptions.UndeliverableMessage"
    assert dead.last_error.startswith("MSG_SIZE_TOO_LARGE")
    assert not SubscriberPause.objects.paused().exists()
    assert sorted(event_ids(consume(kafka_servers, [unique]))) == sorted(
        [str(small.id), str(after.id)]
    )


@pytest.mark.django_db(transaction=True)
def test_broker_killed_mid_batch__paused_then_resumed_nothing_lost(tansu, unique):
    """tansu is killed while a relay process sends, and started again (empty:
    its storage is memory). The relay pauses the publisher, spends no attempt,
    and resumes when tansu is back. Nothing is lost: every event the killed
    broker had not confirmed is in the new one."""
    rows = publish_orders(4000)
    relay = publisher_relay(options(tansu.servers, unique), batch_size=50)
    try:
        wait_for(
            lambda: kit.succeeded() >= 200 or relay.process.poll() is not None,
            60,
            "the relay to deliver some events",
        )
        tansu.stop()
        wait_for(
            lambda: (
                SubscriberPause.objects.paused().exists()
                and not Delivery.objects.filter(state=State.RUNNING).exists()
            ),
            60,
            "the publisher to pause with nothing in flight",
        )
        confirmed = set(kit.succeeded_ids())
        assert len(confirmed) < len(rows), "all delivered before the kill"
        assert not Delivery.objects.filter(attempts__gt=1).exists()
        tansu.start()
        wait_for(
            lambda: kit.succeeded() == len(rows) or relay.process.poll() is not None,
            120,
            "the relay to resume and deliver everything",
        )
    finally:
        stopped(relay)
    assert relay.has("publisher paused") and relay.has("publisher resumed")
    assert kit.states("bus") == {State.SUCCEEDED: len(rows)}
    assert not Delivery.objects.filter(attempts__gt=1).exists()
    received = set(event_ids(consume(tansu.servers, [unique])))
    missing = {str(r.id) for r in rows if r.id not in confirmed} - received
    assert not missing, f"{len(missing)} events lost"


# --- docs/brokers.md ---------------------------------------------------------------


def _kafka_blocks() -> list[str]:
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "brokers.md"
    section = page.read_text().split("## Kafka\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


class _Handled(Exception):
    pass


def test_the_docs_settings_and_consumer_work_against_a_broker(
    publishers, kafka_servers, monkeypatch
):
    """The section's settings block builds a publisher that sends, and its
    consumer loop reads each event (stopped once it handled them all)."""
    settings_block, consumer_block = _kafka_blocks()
    monkeypatch.setenv("KAFKA_BOOTSTRAP_SERVERS", kafka_servers)
    namespace: dict = {}
    exec(compile(settings_block, "docs/brokers.md", "exec"), namespace)
    [(name, entry)] = namespace["OUTBOX_PUBLISHERS"].items()
    sender = build_publisher(name, entry)
    publishers.append(sender)
    sent = [context(n, aggregate_id=str(n % 2)) for n in range(4)]
    assert sender.send_batch(sent) == [None] * 4

    wanted = {str(c.event_id) for c in sent}
    handled: list[tuple[str, dict]] = []

    def handle(event_type, data):
        handled.append((event_type, data))
        if len(handled) == len(sent):
            raise _Handled

    consumer_code = consumer_block.replace("127.0.0.1:9092", kafka_servers)
    reader = {"seen_before": lambda source, event_id: event_id not in wanted}
    reader["handle"] = handle
    try:
        with pytest.raises(_Handled):
            exec(compile(consumer_code, "docs/brokers.md", "exec"), reader)
    finally:
        reader["consumer"].close()
    assert sorted(d["number"] for _, d in handled) == [0, 1, 2, 3]
