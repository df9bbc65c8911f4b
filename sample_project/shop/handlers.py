"""In-process handlers of the shop, found by outbox_app's autodiscovery. Each is
idempotent: a redelivery (at-least-once) changes nothing."""

from decimal import Decimal

from django.core.mail import send_mail
from django.db.models import F

from outbox_app import handler

from .events import OrderCancelled, OrderPaid, OrderPlaced
from .models import ConfirmationEmail, OrderSummary, Product, Reservation

#: Payments at or above this amount (currency units) need a manual review.
REVIEW_THRESHOLD = Decimal(900)


class PaymentFlagged(Exception):
    """A business rule rejected the payment: retrying cannot help, so the
    delivery expires at once (the dead letter an operator may requeue)."""


@handler(OrderPlaced, name="shop.send_confirmation")
def send_confirmation(event: OrderPlaced, context) -> None:
    """Send the confirmation e-mail (EMAIL_BACKEND) and record it, once per order."""
    _, created = ConfirmationEmail.objects.get_or_create(order_id=event.order_id)
    if created:
        send_mail(
            f"Order #{event.order_id} confirmed",
            f"Thank you! Your order of {event.total} is confirmed.",
            "shop@example.com",
            [event.customer_email],
        )


@handler(OrderPlaced, name="shop.reserve_inventory")
def reserve_inventory(event: OrderPlaced, context) -> None:
    """Reserve the ordered units (stock may go negative: a backorder)."""
    if not event.sku:
        return
    product, _ = Product.objects.get_or_create(sku=event.sku)
    _, created = Reservation.objects.get_or_create(
        order_id=event.order_id,
        defaults={"product": product, "quantity": event.quantity},
    )
    if created:
        Product.objects.filter(pk=product.pk).update(stock=F("stock") - event.quantity)


@handler(OrderCancelled, name="shop.release_inventory")
def release_inventory(event: OrderCancelled, context) -> None:
    """Give a cancelled order's reserved units back to stock."""
    released = Reservation.objects.filter(order_id=event.order_id, released=False)
    for reservation in released.select_for_update():
        Product.objects.filter(pk=reservation.product_id).update(
            stock=F("stock") + reservation.quantity
        )
        released.filter(pk=reservation.pk).update(released=True)


@handler(
    OrderPlaced, OrderPaid, OrderCancelled, name="shop.order_summary", ordered=True
)
def order_summary(event, context) -> None:
    """Keep the OrderSummary read model: per order, in publish order."""
    status = {"OrderPlaced": "placed", "OrderPaid": "paid"}.get(
        context.event_type, "cancelled"
    )
    summary, created = OrderSummary.objects.get_or_create(
        order_id=event.order_id, defaults={"status": status, "events_seen": 1}
    )
    if not created:
        summary.status = status
        summary.events_seen += 1
        summary.save()


@handler(OrderPaid, name="shop.fraud_check", give_up_on=[PaymentFlagged])
def fraud_check(event: OrderPaid, context) -> None:
    """Flag large payments for review.

    Raises:
        PaymentFlagged: ``amount`` >= REVIEW_THRESHOLD.
    """
    if event.amount >= REVIEW_THRESHOLD:
        raise PaymentFlagged(f"payment of {event.amount} needs a manual review")
