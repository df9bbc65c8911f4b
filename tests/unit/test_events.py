"""Event classes, the type registry, encoding and decoding (no database)."""

from __future__ import annotations

import dataclasses
import decimal

import pytest
from django.core.exceptions import ImproperlyConfigured

from outbox_app import (
    DuplicateEventType,
    Event,
    EventDecodeError,
    InvalidEventType,
    upcaster,
)
from outbox_app.events.codec import decode, encode
from outbox_app.events.types import event_class
from tests.testapp.events import OrderPlaced


def test_event_type__defaults_to_simple_class_name():
    assert OrderPlaced.event_type == "OrderPlaced"
    assert event_class("OrderPlaced") is OrderPlaced


def test_event_type__can_be_overridden():
    @dataclasses.dataclass(frozen=True)
    class InvoiceRaisedV2(Event):
        event_type = "InvoiceRaised"
        number: str

    assert event_class("InvoiceRaised") is InvoiceRaisedV2


def test_duplicate_event_type__names_both_classes():
    with pytest.raises(DuplicateEventType) as info:

        @dataclasses.dataclass(frozen=True)
        class OrderPlaced(Event):  # same simple name as tests.testapp.events'
            order_id: int

    message = str(info.value)
    assert "tests.testapp.events.OrderPlaced" in message
    assert (
        "test_duplicate_event_type__names_both_classes.<locals>.OrderPlaced" in message
    )
    assert isinstance(info.value, ImproperlyConfigured)


def test_duplicate_event_type__registry_keeps_the_first_class():
    from tests.testapp import events

    with pytest.raises(DuplicateEventType):

        @dataclasses.dataclass(frozen=True)
        class Other(Event):
            event_type = "OrderPlaced"

    assert event_class("OrderPlaced") is events.OrderPlaced


def test_event_type__too_long_class_override_is_refused():
    with pytest.raises(InvalidEventType):

        class TooLong(Event):
            event_type = "y" * 256


def test_encode__revision_is_the_class_revision():
    @dataclasses.dataclass(frozen=True)
    class PriceChanged(Event):
        revision = 3
        price: decimal.Decimal

    encoded = encode(PriceChanged(price=decimal.Decimal("1.10")), max_bytes=1000)
    assert (encoded.event_type, encoded.revision, encoded.payload) == (
        "PriceChanged",
        3,
        {"price": "1.10"},
    )


def test_decode__runs_upcasters_in_order():
    @dataclasses.dataclass(frozen=True)
    class CustomerRenamed(Event):
        revision = 3
        first_name: str
        last_name: str
        source: str

    @upcaster(CustomerRenamed, from_revision=1)
    def split_name(payload):
        first, last = payload.pop("name").split(" ", 1)
        return {**payload, "first_name": first, "last_name": last}

    @upcaster("CustomerRenamed", from_revision=2)
    def add_source(payload):
        return {**payload, "source": "legacy"}

    assert decode("CustomerRenamed", 1, {"name": "Ada Lovelace"}) == CustomerRenamed(
        "Ada", "Lovelace", "legacy"
    )
    assert decode(
        "CustomerRenamed", 3, {"first_name": "A", "last_name": "B", "source": "x"}
    ) == CustomerRenamed("A", "B", "x")


def test_decode__errors_are_named():
    @dataclasses.dataclass(frozen=True)
    class StockCounted(Event):
        revision = 2
        sku: str
        count: int

    with pytest.raises(
        EventDecodeError, match="no Event class defines event type 'Nope'"
    ):
        decode("Nope", 1, {})
    with pytest.raises(EventDecodeError, match="revision 1 has no upcaster"):
        decode("StockCounted", 1, {"sku": "a", "count": 1})
    with pytest.raises(EventDecodeError, match="newer than the class"):
        decode("StockCounted", 3, {"sku": "a", "count": 1})
    with pytest.raises(EventDecodeError, match="unexpected field"):
        decode("StockCounted", 2, {"sku": "a", "quantity": 1})
    with pytest.raises(EventDecodeError, match="count"):
        decode("StockCounted", 2, {"sku": "a"})
    with pytest.raises(EventDecodeError, match="Decimal|decimal"):
        decode("OrderPlaced", 1, {"order_id": 1, "total": "not a number"})
