from decimal import Decimal

from django.db import transaction

from outbox_app import publish

from .events import OrderPlaced
from .models import Order


def place_order(customer_email: str, total: Decimal) -> Order:
    """Save the order and its OrderPlaced event in one transaction."""
    with transaction.atomic():
        order = Order.objects.create(customer_email=customer_email, total=total)
        publish(
            OrderPlaced(order_id=order.pk, customer_email=customer_email, total=total),
            aggregate=order,
        )
    return order
