"""The recording publisher: what the relay would send to a broker, recorded
in the entry's format; record_publishers() puts it in place of the
configured publishers."""

from __future__ import annotations

import decimal

import pytest
from django.db import transaction
from django.test import override_settings

from outbox_app import publish
from outbox_app.exceptions import UnknownSubscriber
from outbox_app.publishing.enqueue import TASK_BACKEND
from outbox_app.relay import registry, relay_once
from outbox_app.testing import RecordingPublisher, record_publishers
from tests.testapp.events import OrderPlaced, Step

pytestmark = pytest.mark.django_db(transaction=True)

BROKERS = {
    "rabbitmq": {
        "URL": "amqp://guest:guest@127.0.0.1:1//",  # never connected to
        "EXCHANGE": "shop.events",
        "ROUTING_KEY": "{aggregate_type}.{event_type}",
    },
    "catalog": {
        "BACKEND": "outbox_app.publishers.kombu.KombuPublisher",
        "URL": "amqp://guest:guest@127.0.0.1:1//",
        "FORMAT": "corewrite",
        "EVENT_TYPES": ["Step"],
    },
    "tasks": {"BACKEND": TASK_BACKEND},
}


def place(order_id: int) -> None:
    with transaction.atomic():
        publish(
            OrderPlaced(order_id=order_id, total=decimal.Decimal("9.90")),
            aggregate=("shop.Order", order_id),
        )


@override_settings(OUTBOX_PUBLISHERS=BROKERS)
def test_the_configured_publishers_record_what_the_relay_sends():
    with record_publishers() as sent:
        place(1)
        with transaction.atomic():
            publish(Step(position=3), aggregate=("shop.Order", 1))
        report = relay_once()
        kinds = {p.name: type(p) for p in registry.publishers()}
    assert report.succeeded == 3  # two to rabbitmq, one to catalog
    assert kinds == {
        "rabbitmq": RecordingPublisher,
        "catalog": RecordingPublisher,
        "tasks": registry.build_publisher("tasks", BROKERS["tasks"]).__class__,
    }
    placed, step = sent.to("rabbitmq")
    assert placed.content_type == "application/cloudevents+json"
    envelope = placed.json()
    assert (envelope["type"], envelope["data"]) == (
        "OrderPlaced",
        {"order_id": 1, "total": "9.90"},
    )
    assert envelope["id"] == str(placed.context.event_id)
    assert placed.event == OrderPlaced(order_id=1, total=decimal.Decimal("9.90"))
    assert placed.context.attempt == 1 and placed.context.subscriber == "rabbitmq"
    assert step.json()["type"] == "Step"
    [core] = sent.to("catalog")
    assert core.content_type == "application/json"
    assert core.json()["PAYLOAD"] == {"position": 3}
    assert len(sent) == 3 and [m.publisher for m in sent].count("rabbitmq") == 2
    # After the block the configured publishers are back.
    assert {type(p).__name__ for p in registry.publishers()} == {
        "KombuPublisher",
        "CeleryPublisher",
    }
    registry.close_publishers()


@override_settings(OUTBOX_PUBLISHERS=BROKERS)
def test_named_publishers_only():
    with record_publishers("catalog") as sent:
        kinds = {p.name: type(p).__name__ for p in registry.publishers()}
    assert kinds["catalog"] == "RecordingPublisher"
    assert kinds["rabbitmq"] == "KombuPublisher"
    assert len(sent) == 0
    registry.close_publishers()
    with (
        pytest.raises(
            UnknownSubscriber,
            match="no OUTBOX_PUBLISHERS entry is named 'rabbit'; configured: "
            "rabbitmq, catalog, tasks",
        ),
        record_publishers("rabbit"),
    ):
        pass


@override_settings(
    OUTBOX_PUBLISHERS={
        "recorder": {
            "BACKEND": "outbox_app.testing.RecordingPublisher",
            "EVENT_TYPES": ["OrderPlaced"],
        }
    }
)
def test_a_recording_publisher_in_the_settings(outbox_publishers):
    place(2)
    with transaction.atomic():
        publish(Step(position=1))  # not its type
    assert relay_once().succeeded == 1
    [message] = outbox_publishers.to("recorder")
    assert message.event.order_id == 2
    outbox_publishers.clear()
    assert outbox_publishers.messages == []


@override_settings(
    OUTBOX_PUBLISHERS={
        "debezium": {
            "BACKEND": "outbox_app.testing.RecordingPublisher",
            "FORMAT": "debezium",
        }
    }
)
def test_the_body_is_in_the_entry_s_format(outbox_publishers):
    place(3)
    assert relay_once().succeeded == 1
    [placed] = outbox_publishers
    assert placed.json() == {"order_id": 3, "total": "9.90"}  # the payload alone
