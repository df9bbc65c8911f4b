"""outbox_app.testing in Django's own test cases, as a project's tests.py uses
it: ``TestCase`` (one transaction per test, never committed) and
``TransactionTestCase`` (real commits)."""

from __future__ import annotations

import decimal

import pytest
from django.db import transaction
from django.test import TestCase, TransactionTestCase, override_settings

from outbox_app import handler, publish
from outbox_app.exceptions import HandlerFailed, PublishedMismatch
from outbox_app.models import Subscription
from outbox_app.relay import registry, relay_once
from outbox_app.testing import capture_events, record_publishers
from tests.testapp.events import OrderPlaced
from tests.testapp.models import Order, SideEffect

#: Django's test cases carry no django_db mark: they run on every database.
pytestmark = pytest.mark.every_database


def place_order(reference: str, total: str) -> Order:
    """What a project's service does: the order and its event, one transaction."""
    with transaction.atomic():
        order = Order.objects.create(reference=reference, total=total)
        publish(
            OrderPlaced(order_id=order.pk, total=decimal.Decimal(total)),
            aggregate=order,
        )
    return order


def record(event, context):
    SideEffect.objects.get_or_create(handler="record", event_id=context.event_id)
    transaction.on_commit(lambda: sent.append(event.order_id))
    if event.total > 1000:
        raise ValueError(f"order {event.order_id} needs a review")


sent: list[int] = []


class Captured:
    """A test case's set-up: a capture around each test, ``record`` a handler."""

    def setUp(self):
        self.outbox = self.enterContext(capture_events())
        handler(OrderPlaced, name="testcase.record", max_attempts=2)(record)
        self.addCleanup(registry.unregister, "testcase.record")
        # Recorded, as a project's migrate records its handlers.
        Subscription.objects.record([registry.get("testcase.record")], "tests")
        sent.clear()


class CaptureInATestCase(Captured, TestCase):
    def test_what_the_test_published_would_commit(self):
        order = place_order("A-1", "9.90")
        [placed] = self.outbox.assert_published(OrderPlaced, order_id=order.pk)
        self.assertEqual(placed.context.aggregate_id, str(order.pk))
        self.assertEqual(placed.context.aggregate_type, "testapp.Order")
        with self.assertRaises(PublishedMismatch):
            self.outbox.assert_published(OrderPlaced, order_id=order.pk + 1)

    def test_a_rolled_back_order_published_nothing_that_stays(self):
        with self.assertRaises(RuntimeError), transaction.atomic():
            place_order("A-2", "9.90")
            raise RuntimeError("payment declined")
        self.outbox.assert_not_published()
        self.assertEqual(len(self.outbox.rolled_back), 1)

    def test_deliver_now_runs_the_handlers_and_their_callbacks(self):
        order = place_order("A-3", "9.90")
        report = self.outbox.deliver_now()
        self.assertEqual([o.handler for o in report.succeeded], ["testcase.record"])
        self.assertEqual(SideEffect.objects.count(), 1)
        self.assertEqual(sent, [order.pk])  # as after the relay's commit

    def test_deliver_now_raises_what_the_handler_raised(self):
        order = place_order("A-4", "5000")
        with self.assertRaises(HandlerFailed) as failed:
            self.outbox.deliver_now()
        error = failed.exception
        self.assertIn(f"ValueError: order {order.pk} needs a review", str(error))
        self.assertIsInstance(error.__cause__, ValueError)
        self.assertEqual(SideEffect.objects.count(), 0)
        self.assertEqual(sent, [])

    @override_settings(
        OUTBOX_PUBLISHERS={
            "rabbitmq": {"URL": "amqp://127.0.0.1:1//", "EXCHANGE": "shop.events"}
        }
    )
    def test_the_relay_in_the_test_s_transaction_sends_to_a_recorder(self):
        Subscription.objects.record(registry.publishers(), "tests")
        order = place_order("A-5", "9.90")
        with record_publishers() as messages:
            relay_once()
        [message] = messages.to("rabbitmq")
        self.assertEqual(message.json()["data"]["order_id"], order.pk)


class CaptureInATransactionTestCase(Captured, TransactionTestCase):
    def test_committed_and_rolled_back(self):
        order = place_order("B-1", "9.90")
        with self.assertRaises(RuntimeError), transaction.atomic():
            place_order("B-2", "9.90")
            raise RuntimeError
        self.outbox.assert_published_once(OrderPlaced, order_id=order.pk)
        self.outbox.deliver_now()
        self.assertEqual(sent, [order.pk])
        # Committed: the relay delivers it as well.
        self.assertEqual(relay_once().succeeded, 1)
        self.assertEqual(sent, [order.pk, order.pk])
