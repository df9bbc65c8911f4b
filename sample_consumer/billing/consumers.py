"""The shop's events billing consumes, run by ``python -m django consume``.

The shop's Event classes are not imported here (another service's code): the
events arrive as the CloudEvents' ``data`` dicts. An order's OrderPaid may be
run before its OrderPlaced (two consumers of one queue, each with its own
inbox rows): it then fails and is retried from the database until the invoice
exists.
"""

from decimal import Decimal

from django.conf import settings
from django.db.models import F

from outbox_app import consumer

from .models import Invoice

QUEUE = settings.BILLING_QUEUE


@consumer("OrderPlaced", queue=QUEUE, bindings=["shop.Order.#"], name="billing.invoice")
def open_invoice(data: dict, context) -> None:
    Invoice.objects.create(
        order_id=data["order_id"],
        customer_email=data["customer_email"],
        total=Decimal(data["total"]),
    )


@consumer("OrderPaid", queue=QUEUE, bindings=["shop.Order.#"], name="billing.payment")
def record_payment(data: dict, context) -> None:
    updated = Invoice.objects.filter(order_id=data["order_id"]).update(
        payments=F("payments") + 1, paid=F("paid") + Decimal(data["amount"])
    )
    if not updated:  # its OrderPlaced has not been consumed yet: retried later
        raise LookupError(f"no invoice for order {data['order_id']} yet")
