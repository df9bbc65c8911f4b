"""The CoreWrite wire format (``FORMAT: corewrite``): the JSON object a
CoreWrite subscriber reads, from a tracked change or any published event."""

from __future__ import annotations

import datetime
import json
import uuid

import pytest

from outbox_app.publishers.base import FORMATS, render, template_fields, wire_format
from outbox_app.publishers.corewrite import body, to_corewrite
from outbox_app.subscribers import DeliveryContext

EVENT_ID = uuid.UUID("0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10")
KEYS = [
    "OUTBOX_ID",
    "EVENT_TYPE",
    "AGGREGATE_ID",
    "AGGREGATE_TYPE",
    "OPERATION",
    "PAYLOAD",
    "METADATA",
    "USER",
    "CREATED_AT",
    "STATUS",
]


def make(**fields) -> DeliveryContext:
    values = {
        "event_id": EVENT_ID,
        "namespace": "shop",
        "event_type": "GadgetUpdated",
        "revision": 1,
        "payload": {
            "pk": 123,
            "changed": {"price": "89.99"},
            "previous": {"price": "99.99"},
        },
        "aggregate_type": "Gadget",
        "aggregate_id": "123",
        "aggregate_version": None,
        "headers": {"actor": "7", "metadata": {"path": "/gadgets/123"}},
        "tenant_id": None,
        "action_id": None,
        "occurred_at": datetime.datetime(
            2025, 12, 19, 18, 0, tzinfo=datetime.timezone(datetime.timedelta(hours=1))
        ),
        "attempt": 1,
        "subscriber": "bus",
        "delivery_id": 1,
        "operation": "update",
    }
    values.update(fields)
    return DeliveryContext(**values)


def test_a_tracked_update():  # tests.testapp's Gadget: its key is "id"
    assert to_corewrite(make()) == {
        "OUTBOX_ID": str(EVENT_ID),
        "EVENT_TYPE": "GadgetUpdated",
        "AGGREGATE_ID": "123",
        "AGGREGATE_TYPE": "Gadget",
        "OPERATION": "PATCH",
        "PAYLOAD": {"id": 123, "price": "89.99"},
        "PREVIOUS_PAYLOAD": {"price": "99.99"},
        "METADATA": {"path": "/gadgets/123"},
        "USER": "7",
        "CREATED_AT": "20251219170000",
        "STATUS": "PUBLISHED",
    }


@pytest.mark.parametrize(
    "operation, wire",
    [("create", "POST"), ("soft_delete", "DELETE"), ("delete", "DELETE")],
)
def test_a_tracked_create_or_delete_carries_every_value(operation, wire):
    event = to_corewrite(
        make(operation=operation, payload={"pk": 5, "values": {"name": "Lamp"}})
    )
    assert list(event) == KEYS
    assert event["OPERATION"] == wire
    assert event["PAYLOAD"] == {"id": 5, "name": "Lamp"}


def test_any_other_event_fills_the_same_keys_from_its_own_fields():
    event = to_corewrite(
        make(
            event_type="OrderPlaced",
            payload={"order_id": 1},
            aggregate_type=None,
            aggregate_id=None,
            operation=None,
            headers={},
        )
    )
    assert list(event) == KEYS
    assert event["PAYLOAD"] == {"order_id": 1}
    assert (event["AGGREGATE_ID"], event["AGGREGATE_TYPE"]) == (None, None)
    assert (event["OPERATION"], event["METADATA"], event["USER"]) == ("POST", {}, None)
    assert to_corewrite(make(operation="archive"))["OPERATION"] == "ARCHIVE"
    assert to_corewrite(make(headers={"actor": 7}))["USER"] == "7"
    assert json.loads(body(make())) == to_corewrite(make())


def test_the_format_is_chosen_per_publisher_and_spells_the_routing_key():
    corewrite = wire_format("bus", {"FORMAT": "corewrite"})
    assert corewrite is FORMATS["corewrite"]
    assert corewrite.content_type == "application/json"
    assert wire_format("bus", {}) is FORMATS["cloudevents"]
    with pytest.raises(Exception, match="'FORMAT' must be one of"):
        wire_format("bus", {"FORMAT": "avro"})
    key = "{dimension}.{operation}"
    used = template_fields("bus", "ROUTING_KEY", key)
    assert render(key, used, make(), corewrite) == "gadget.patch"
    assert render(key, used, make()) == "gadget.update"


def test_a_tracked_change_names_the_fields_it_left_out_in_its_metadata():
    # A row over OUTBOX_MAX_PAYLOAD_BYTES: its largest values are left out of
    # the event and named; the subscriber reads them from the source.
    create = to_corewrite(
        make(
            operation="create",
            payload={"pk": 11, "values": {"name": "Lamp"}, "omitted": ["manual"]},
        )
    )
    assert list(create) == KEYS
    assert create["PAYLOAD"] == {"id": 11, "name": "Lamp"}
    assert create["METADATA"] == {"path": "/gadgets/123", "omitted": ["manual"]}
    update = to_corewrite(
        make(payload={"pk": 11, "changed": {}, "previous": {}, "omitted": ["manual"]})
    )
    assert (update["PAYLOAD"], update["PREVIOUS_PAYLOAD"]) == ({"id": 11}, {})
    assert update["METADATA"]["omitted"] == ["manual"]
    # The outbox's names win over an acting() key of the same name; a change
    # that left nothing out has none of its own.
    clash = make(
        headers={"metadata": {"omitted": "mine"}},
        payload={"pk": 11, "changed": {}, "previous": {}, "omitted": ["manual"]},
    )
    assert to_corewrite(clash)["METADATA"] == {"omitted": ["manual"]}
    assert "omitted" not in to_corewrite(make())["METADATA"]
