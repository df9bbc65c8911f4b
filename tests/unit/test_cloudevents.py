"""The CloudEvents 1.0 JSON envelope (structured mode) of a delivery."""

from __future__ import annotations

import datetime
import json
import re
import uuid
from zoneinfo import ZoneInfo

import pytest

from outbox_app.events import codec
from outbox_app.publishers.cloudevents import CONTENT_TYPE, body, rfc3339, to_cloudevent
from outbox_app.subscribers import DeliveryContext

EVENT_ID = uuid.UUID("0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10")
ACTION_ID = uuid.UUID("0190b6f0-6d2b-7aa0-9b1e-5d2c4e6f8a01")


def make(**fields) -> DeliveryContext:
    values = {
        "event_id": EVENT_ID,
        "namespace": "shop",
        "event_type": "OrderPlaced",
        "revision": 2,
        "payload": {"order_id": 42, "total": "19.90", "lines": [{"sku": "A"}]},
        "aggregate_type": "shop.Order",
        "aggregate_id": "42",
        "aggregate_version": 3,
        "headers": {"correlation_id": "req-7f3a", "causation_id": 12, "actor": "u"},
        "tenant_id": "acme",
        "action_id": ACTION_ID,
        "occurred_at": datetime.datetime(2025, 6, 1, 12, 0, 0, 123456, datetime.UTC),
        "attempt": 3,
        "subscriber": "rabbitmq",
        "delivery_id": 99,
    }
    values.update(fields)
    return DeliveryContext(**values)


def test_every_attribute():
    assert to_cloudevent(make()) == {
        "specversion": "1.0",
        "id": "0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10",
        "source": "shop",
        "type": "OrderPlaced",
        "subject": "42",
        "time": "2025-06-01T12:00:00.123456Z",
        "datacontenttype": "application/json",
        "data": {"order_id": 42, "total": "19.90", "lines": [{"sku": "A"}]},
        "revision": 2,
        "aggregatetype": "shop.Order",
        "aggregateversion": 3,
        "tenantid": "acme",
        "actionid": "0190b6f0-6d2b-7aa0-9b1e-5d2c4e6f8a01",
        "correlationid": "req-7f3a",
        "causationid": "12",
        "actor": "u",
    }
    assert CONTENT_TYPE == "application/cloudevents+json"


def test_the_database_alias_is_not_on_the_wire_but_may_route():
    """One event published on several databases is one event to a consumer:
    the same envelope from each shard (its inbox takes the second copy as a
    duplicate); a destination template may still name the alias."""
    from outbox_app.publishers.base import render, template_fields

    assert to_cloudevent(make(using="shard2")) == to_cloudevent(make())
    key = "{using}.{event_type}"
    used = template_fields("bus", "ROUTING_KEY", key)
    assert render(key, used, make(using="shard2")) == "shard2.OrderPlaced"


def test_who_acted_and_the_metadata_are_text_attributes():
    headers = {"actor": 7, "metadata": {"path": "/orders/", "ip": "10.0.0.5"}}
    event = to_cloudevent(make(headers=headers))
    assert event["actor"] == "7"
    assert json.loads(event["metadata"]) == headers["metadata"]
    assert to_cloudevent(make(headers={"actor": {"id": 7}}))["actor"] == '{"id":7}'
    assert "metadata" not in to_cloudevent(make(headers={"metadata": {}}))


def test_a_scheduled_event_carries_its_schedule():
    due = datetime.datetime(2025, 6, 2, 9, 0, tzinfo=ZoneInfo("Europe/Paris"))
    event = to_cloudevent(
        make(deliver_at=due, expires_at=due + datetime.timedelta(hours=1))
    )
    assert event["deliverat"] == "2025-06-02T07:00:00Z"
    assert event["expiretime"] == "2025-06-02T08:00:00Z"


def test_absent_values_are_omitted_not_null():
    event = to_cloudevent(
        make(
            aggregate_type=None,
            aggregate_id=None,
            aggregate_version=None,
            tenant_id=None,
            action_id=None,
            headers={},
        )
    )
    assert set(event) == {
        "specversion",
        "id",
        "source",
        "type",
        "time",
        "datacontenttype",
        "data",
        "revision",
    }
    assert None not in event.values()


def test_attribute_names_follow_the_naming_rule():
    # CloudEvents core spec: lowercase ASCII letters and digits only.
    for name in to_cloudevent(make()):
        assert re.fullmatch(r"[a-z0-9]+", name), name


def test_delivery_details_are_not_part_of_the_event():
    # A redelivery sends the same event: attempt/subscriber/delivery differ.
    first = to_cloudevent(make())
    assert first == to_cloudevent(make(attempt=1, subscriber="x", delivery_id=1))


def test_json_round_trip_and_zero_aggregate_version_kept():
    event = to_cloudevent(make(aggregate_version=0, payload={}))
    assert event["aggregateversion"] == 0
    assert event["data"] == {}
    assert json.loads(json.dumps(event)) == event


def test_time_is_rfc3339_utc():
    paris = datetime.datetime(2025, 6, 1, 14, 0, tzinfo=ZoneInfo("Europe/Paris"))
    assert rfc3339(paris) == "2025-06-01T12:00:00Z"
    assert rfc3339(datetime.datetime(2025, 1, 2, 3, 4, 5)) == "2025-01-02T03:04:05Z"
    assert rfc3339(datetime.datetime(2025, 1, 2, 3, 4, 5, 7, datetime.UTC)) == (
        "2025-01-02T03:04:05.000007Z"
    )


def test_a_sentinel_row_is_not_an_event():
    with pytest.raises(ValueError, match="no event type"):
        to_cloudevent(make(event_type=None))


def test_the_body_is_the_envelope_as_compact_utf8_json():
    context = make(payload={"name": "grüße", "n": 1})
    assert json.loads(body(context)) == to_cloudevent(context)
    assert "grüße".encode() in body(context)  # not \\u-escaped


def test_a_payload_integer_beyond_64_bits_is_sent_unchanged():
    huge = 2**70 + 1
    assert json.loads(body(make(payload={"n": huge})))["data"] == {"n": huge}


@pytest.mark.parametrize(
    "text",
    [
        '{"n": 1180591620717411303425}',  # beyond 64 bits: stays an int
        '{"s": "\\ud800"}',  # a lone surrogate, which Python's json keeps
        '{"a": [1.5, true, null, "x"], "b": {"c": -3}}',
    ],
)
def test_stored_json_is_read_as_the_standard_library_reads_it(text):
    assert codec.loads(text) == json.loads(text)


def test_the_inbox_reads_back_every_attribute_a_publisher_writes():
    """One table maps the attributes both ways: what a relay sends, the
    inbox's context gives back field for field (the headers as the text on
    the wire), and nothing of the inbox reads it through the publishers."""
    from outbox_app.events.cloudevents import parse
    from outbox_app.inbox.context import context_for
    from outbox_app.inbox.registry import Consumer
    from tests.unit.test_layers import imports

    due = datetime.datetime(2025, 6, 2, 7, 0, tzinfo=datetime.UTC)
    headers = {**make().headers, "metadata": {"path": "/orders/"}}
    sent = make(deliver_at=due, expires_at=due, operation="update", headers=headers)
    consumer = Consumer(name="c", fn=print, event_types=None, queue="q")
    got = context_for(parse(body(sent)), consumer, "q", attempt=2)
    assert (got.message_id, got.event_id) == (str(EVENT_ID), EVENT_ID)
    assert got.source == sent.namespace
    for name in (
        "event_type",
        "revision",
        "payload",
        "aggregate_type",
        "aggregate_id",
        "aggregate_version",
        "tenant_id",
        "occurred_at",
        "deliver_at",
        "expires_at",
        "operation",
    ):
        assert getattr(got, name) == getattr(sent, name), name
    assert got.action_id == str(ACTION_ID)
    assert got.headers == {
        "correlation_id": "req-7f3a",
        "causation_id": "12",
        "actor": "u",
        "metadata": '{"path":"/orders/"}',
    }
    assert "publishers" not in imports()["inbox"]


def test_every_field_of_a_delivery_is_sent_or_named_as_the_deliverys_own():
    """A field added to DeliveryContext is sent (an attribute of the table)
    or named here as a detail of one delivery: never silently left out."""
    from dataclasses import fields

    from outbox_app.events.cloudevents import ATTRIBUTES

    own = {"attempt", "subscriber", "delivery_id", "using", "payload_bytes"}
    own |= {"position"}
    sent = {a.field for a in ATTRIBUTES if a.kind != "header"} | {"headers"}
    assert {f.name for f in fields(DeliveryContext)} == own | sent
