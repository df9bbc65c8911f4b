"""In-process handlers of the shop, found by outbox_app's autodiscovery."""

from outbox_app import handler

from .events import OrderPlaced
from .models import ConfirmationEmail


@handler(OrderPlaced, name="shop.send_confirmation")
def send_confirmation(event: OrderPlaced, context) -> None:
    """Record the confirmation e-mail. A database write only, so it commits with
    the notification's SUCCEEDED mark: exactly once."""
    ConfirmationEmail.objects.get_or_create(order_id=event.order_id)
