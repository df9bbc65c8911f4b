"""The shop's own tests, in Django's ``TestCase``: what each service publishes
(``outbox_app.testing.capture_events``), what the handlers do with it
(``deliver_now()``), what the broker publishers would send
(``record_publishers()``).

Run by Django's runner, ``python manage.py test sample_project.shop``, and by
pytest, ``python -m pytest sample_project`` (with ``test_api.py``).
"""

from decimal import Decimal

from django.core import mail
from django.test import TestCase

from outbox_app.exceptions import HandlerFailed
from outbox_app.relay import relay_once
from outbox_app.testing import capture_events, record_publishers

from . import services
from .events import OrderCancelled, OrderPaid, OrderPlaced, WalletDeposited
from .handlers import PaymentFlagged
from .models import Listing, OrderSummary, Product

ANA = "ana@example.com"


class ShopTestCase(TestCase):
    def setUp(self):
        self.outbox = self.enterContext(capture_events())


class PlaceOrderTests(ShopTestCase):
    def test_placing_an_order_publishes_order_placed(self):
        order = services.place_order(ANA, Decimal("19.90"), sku="TEA", quantity=2)
        placed = self.outbox.assert_published_once(
            OrderPlaced, order_id=order.pk, sku="TEA", quantity=2
        )
        self.assertEqual(placed.event.total, Decimal("19.90"))
        self.assertEqual(placed.context.aggregate_type, "shop.Order")
        self.assertEqual(placed.context.aggregate_id, str(order.pk))

    def test_the_handlers_confirm_reserve_and_summarise(self):
        order = services.place_order(ANA, Decimal("19.90"), sku="TEA", quantity=2)
        report = self.outbox.deliver_now()
        self.assertEqual(
            sorted(o.handler for o in report.succeeded),
            ["shop.order_summary", "shop.reserve_inventory", "shop.send_confirmation"],
        )
        [confirmation] = mail.outbox
        self.assertEqual(confirmation.subject, f"Order #{order.pk} confirmed")
        self.assertEqual(Product.objects.get(sku="TEA").stock, -2)
        self.assertEqual(OrderSummary.objects.get(order_id=order.pk).status, "placed")

    def test_cancelling_releases_the_reserved_units(self):
        order = services.place_order(ANA, Decimal("5"), sku="CUP", quantity=3)
        services.cancel_order(order.pk)  # OrderCancelled, by the translator
        self.outbox.assert_published_once(OrderCancelled, order_id=order.pk)
        self.outbox.deliver_now()
        self.assertEqual(Product.objects.get(sku="CUP").stock, 0)
        self.assertEqual(
            OrderSummary.objects.get(order_id=order.pk).status, "cancelled"
        )


class PaymentTests(ShopTestCase):
    def test_an_overdraft_publishes_nothing_that_stays(self):
        services.deposit(ANA, Decimal("5"))
        order = services.place_order(ANA, Decimal("19.90"))
        self.outbox.clear()  # what the set-up published
        with self.assertRaises(services.InsufficientFunds):
            services.pay_order(order.pk)
        self.outbox.assert_not_published()
        self.assertEqual(
            [c.event_type for c in self.outbox.rolled_back],
            ["PaymentCreated", "OrderPaid", "WalletWithdrawn"],
        )

    def test_a_large_payment_goes_to_the_dead_letter_of_the_fraud_check(self):
        services.deposit(ANA, Decimal("1000"))
        order = services.place_order(ANA, Decimal("950"))
        services.pay_order(order.pk)
        self.outbox.assert_published_once(WalletDeposited, owner=ANA)
        self.outbox.assert_published_once(OrderPaid, order_id=order.pk)
        with (
            self.assertRaises(HandlerFailed) as failed,
            self.assertLogs("outbox_app.testing", "WARNING") as logged,
        ):
            self.outbox.deliver_now()
        self.assertIn("DEAD (attempt 1): payment of 950.00", logged.output[0])
        [dead] = failed.exception.report.dead
        self.assertEqual((dead.handler, dead.attempts), ("shop.fraud_check", 1))
        self.assertIsInstance(dead.error, PaymentFlagged)  # give_up_on: no retry
        # The other handlers delivered their events, in order.
        self.assertEqual(OrderSummary.objects.get(order_id=order.pk).status, "paid")


class BrokerTests(ShopTestCase):
    def test_the_relay_sends_cloudevents_and_corewrite(self):
        with record_publishers() as sent:
            order = services.place_order(ANA, Decimal("19.90"))
            tea = Listing.objects.create(title="Sencha", price=Decimal("4.50"))
            relay_once()
        [placed] = [m for m in sent.to("broker") if m.event_type == "OrderPlaced"]
        envelope = placed.json()
        self.assertEqual(envelope["source"], "sample-shop")
        self.assertEqual(envelope["data"]["order_id"], order.pk)
        [created] = sent.to("catalog")  # ListingCreated only
        self.assertEqual(created.json()["AGGREGATE_ID"], str(tea.pk))
        self.assertEqual(created.json()["OPERATION"], "POST")
