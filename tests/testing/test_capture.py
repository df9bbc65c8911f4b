"""capture_events() and its assertions, in pytest-django: what a block
published, as the relay would read it, in the test's transaction (which
never commits) and in transactions that commit or roll back."""

from __future__ import annotations

import decimal
import threading

import pytest
from django.db import transaction

from outbox_app import publish
from outbox_app.exceptions import InvalidEventType, PublishedMismatch
from outbox_app.testing import capture_events
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import Product

pytestmark = pytest.mark.django_db


def place(order_id: int, total: str = "9.90", **options):
    with transaction.atomic():
        return publish(
            OrderPlaced(order_id=order_id, total=decimal.Decimal(total)),
            aggregate=("shop.Order", order_id),
            **options,
        )


def test_what_the_block_published_as_the_relay_reads_it():
    place(0)  # before the block: not captured
    with capture_events() as outbox:
        [row] = place(1, headers={"correlation_id": "req-1"})
    place(2)  # after it: not captured either
    [captured] = outbox.assert_published(OrderPlaced, order_id=1)
    assert captured.id == row.id and not captured.rolled_back
    assert captured.event == OrderPlaced(order_id=1, total=decimal.Decimal("9.90"))
    context = captured.context
    assert context.payload == {"order_id": 1, "total": "9.90"}  # as stored
    assert (context.aggregate_type, context.aggregate_id) == ("shop.Order", "1")
    assert context.headers["correlation_id"] == "req-1"
    assert (context.namespace, context.using, context.attempt) == (
        "tests",
        "default",
        1,
    )
    assert [c.event.order_id for c in outbox.events] == [1]


def test_an_event_rolled_back_with_its_savepoint_is_kept_apart():
    with capture_events() as outbox:
        place(1)
        try:
            with transaction.atomic():
                place(2)
                raise RuntimeError("the order failed")
        except RuntimeError:
            pass
    assert [c.event.order_id for c in outbox.events] == [1]
    assert [c.event.order_id for c in outbox.rolled_back] == [2]
    assert [c.rolled_back for c in outbox.published] == [False, True]
    outbox.assert_not_published(OrderPlaced, order_id=2)
    with pytest.raises(PublishedMismatch) as failed:
        outbox.assert_published(OrderPlaced, order_id=2)
    assert str(failed.value) == (
        "expected OrderPlaced with order_id=2 to be published; published (2):\n"
        '  1. OrderPlaced {"order_id":1,"total":"9.90"}, aggregate shop.Order 1\n'
        '  2. OrderPlaced {"order_id":2,"total":"9.90"}, aggregate shop.Order 2 '
        "(rolled back)"
    )


def test_a_savepoint_that_rolls_back_later_is_read_when_asked():
    with capture_events() as outbox:
        sid = transaction.savepoint()
        place(1)
    assert len(outbox.events) == 1
    transaction.savepoint_rollback(sid)
    assert outbox.events == [] and len(outbox.rolled_back) == 1


def test_the_messages_of_failed_assertions():
    with capture_events() as outbox:
        pass
    with pytest.raises(PublishedMismatch, match="nothing was published$"):
        outbox.assert_published(OrderPlaced)
    outbox.assert_not_published()
    with capture_events() as outbox:
        place(1)
        place(1, total="5")
    with pytest.raises(
        PublishedMismatch,
        match=r"^expected one OrderPlaced with order_id=1 to be published, found 2; "
        r"published \(2\):\n  1. OrderPlaced",
    ):
        outbox.assert_published_once(OrderPlaced, order_id=1)
    with pytest.raises(PublishedMismatch, match="^expected nothing to be published"):
        outbox.assert_not_published()
    with pytest.raises(
        PublishedMismatch, match="^expected no OrderPlaced to be published, found 2;"
    ):
        outbox.assert_not_published(OrderPlaced)
    with pytest.raises(
        PublishedMismatch, match="^OrderPlaced has no field 'ordr_id'; its fields: "
    ):
        outbox.assert_published(OrderPlaced, ordr_id=1)
    with pytest.raises(InvalidEventType):
        outbox.assert_published(42)


def test_matching_by_class_fields_instance_and_type_name():
    with capture_events() as outbox:
        place(1, total="5.00")
        with transaction.atomic():
            publish({"event_type": "Untyped", "payload": {"sku": "tea", "units": 2}})
    placed = outbox.assert_published_once(
        OrderPlaced, order_id=1, total=decimal.Decimal("5")
    )
    assert outbox.assert_published(
        OrderPlaced(order_id=1, total=decimal.Decimal("5.00"))
    ) == [placed]
    assert outbox.assert_published("OrderPlaced") == [placed]
    untyped = outbox.assert_published_once("Untyped", sku="tea", units=2)
    assert untyped.event == {"sku": "tea", "units": 2}
    outbox.assert_not_published("Untyped", units=3)
    outbox.assert_not_published(Step)


def test_every_write_that_publishes_is_captured():
    with capture_events() as outbox:
        product = Product.objects.create(name="tea", price=decimal.Decimal("3.50"))
        product.price = decimal.Decimal("3.90")
        product.save()
    created, updated = outbox.events
    assert (created.context.operation, updated.context.operation) == (
        "create",
        "update",
    )
    assert created.context.aggregate_id == str(product.pk)


def test_captures_nest_and_clear():
    with capture_events() as outer:
        place(1)
        with capture_events() as inner:
            place(2)
        place(3)
    assert [c.event.order_id for c in outer.events] == [1, 2, 3]
    assert [c.event.order_id for c in inner.events] == [2]
    outer.clear()
    assert outer.published == []


@pytest.mark.django_db(transaction=True)
def test_other_threads_publishes_are_captured():
    def place_elsewhere():
        try:
            place(7)
        finally:
            from django.db import connection

            connection.close()

    with capture_events() as outbox:
        thread = threading.Thread(target=place_elsewhere)
        thread.start()
        thread.join()
    outbox.assert_published_once(OrderPlaced, order_id=7)


@pytest.mark.django_db(transaction=True)
def test_transactions_that_commit_and_roll_back():
    with capture_events() as outbox:
        place(1)  # commits
        try:
            with transaction.atomic():
                place(2)
                raise RuntimeError
        except RuntimeError:
            pass
    assert [c.event.order_id for c in outbox.events] == [1]
    assert [c.event.order_id for c in outbox.rolled_back] == [2]


@pytest.mark.django_db(databases=["default", "shard2"])
def test_an_event_published_on_two_databases_is_captured_on_each():
    with (
        capture_events() as outbox,
        transaction.atomic(),
        transaction.atomic(using="shard2"),
    ):
        publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(1)),
            using=["default", "shard2"],
        )
    first, second = outbox.assert_published(OrderPlaced, order_id=1)
    assert (first.using, second.using) == ("default", "shard2")
    assert first.id == second.id
    assert "on 'shard2'" in second.describe()


def test_the_outbox_fixture_captures_the_test(outbox):
    place(1)
    outbox.assert_published_once(OrderPlaced, order_id=1)
