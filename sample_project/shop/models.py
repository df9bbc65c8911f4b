"""The sample shop: orders, payments, wallets, inventory, a read model, and the
broker consumer's record of consumed messages."""

from decimal import Decimal

from django.db import models

from outbox_app import RecordsEvents, track

from .domain import OrderWithdrawn


class Product(models.Model):
    """Inventory: units on hand; reservations take from ``stock``."""

    sku = models.CharField(max_length=32, unique=True)
    stock = models.IntegerField(default=0)

    def __str__(self) -> str:
        return self.sku


class Order(RecordsEvents, models.Model):
    """An aggregate that records what happens to it
    (``outbox_app.publishing.aggregates``): ``cancel()`` records the domain
    event OrderWithdrawn, which ``shop/translators.py`` publishes as the
    integration event OrderCancelled when the order is saved."""

    class Status(models.TextChoices):
        PLACED = "placed"
        PAID = "paid"
        CANCELLED = "cancelled"

    customer_email = models.EmailField()
    total = models.DecimalField(max_digits=10, decimal_places=2)
    sku = models.CharField(max_length=32, blank=True, default="")
    quantity = models.PositiveIntegerField(default=1)
    status = models.CharField(max_length=16, choices=Status, default=Status.PLACED)
    placed_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Order #{self.pk} ({self.customer_email})"

    def cancel(self) -> None:
        """Cancel a placed order; ``save()`` publishes OrderCancelled.

        Raises:
            ValueError: the order is not placed (paid or cancelled already).
        """
        if self.status != self.Status.PLACED:
            raise ValueError(f"order {self.pk} is {self.status}")
        self.status = self.Status.CANCELLED
        self.record(OrderWithdrawn(order_id=self.pk))


class ConfirmationEmail(models.Model):
    """Written by the OrderPlaced handler with the e-mail it sends: one per order."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    sent_at = models.DateTimeField(auto_now_add=True)


class Wallet(models.Model):
    """A customer's balance. The CHECK constraint is the insufficient-funds rule:
    a withdrawal that would overdraw fails and its transaction rolls back."""

    owner = models.EmailField(unique=True)
    balance = models.DecimalField(max_digits=12, decimal_places=2, default=Decimal(0))

    class Meta:
        constraints = [
            models.CheckConstraint(
                condition=models.Q(balance__gte=0), name="shop_wallet_not_overdrawn"
            )
        ]


@track
class Payment(models.Model):
    """Tracked (``@outbox_app.track``): each write publishes a change event,
    PaymentCreated when a payment is made."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    amount = models.DecimalField(max_digits=10, decimal_places=2)
    paid_at = models.DateTimeField(auto_now_add=True)


class Reservation(models.Model):
    """Written by the inventory handler for OrderPlaced, released on cancel."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    product = models.ForeignKey(Product, on_delete=models.PROTECT)
    quantity = models.PositiveIntegerField()
    released = models.BooleanField(default=False)


class OrderSummary(models.Model):
    """Read model kept by the ordered handler: each order's last known status."""

    order_id = models.BigIntegerField(primary_key=True)
    status = models.CharField(max_length=16)
    events_seen = models.PositiveIntegerField(default=0)


class ConsumedMessage(models.Model):
    """One row per broker message consumed (``shop/consumers.py``, run by
    ``manage.py consume``); its unique ``message_id`` (the outbox event id)
    would make a second effect fail: the inbox never runs one twice."""

    message_id = models.CharField(max_length=64, unique=True)
    event_type = models.CharField(max_length=255)
    consumed_at = models.DateTimeField(auto_now_add=True)


@track(
    aggregate_type="LST",
    soft_delete="withdrawn_at",
    names={"soft_delete": "Deleted", "delete": "ForceDeleted"},
)
class Listing(models.Model):
    """A product's page in the catalog, searchable. Tracked the way CoreWrite
    subscribers expect (``FORMAT: corewrite`` on the ``catalog`` publisher):
    aggregate type ``LST``, ``ListingDeleted`` when withdrawn (a soft delete),
    ``ListingForceDeleted`` when deleted for good."""

    title = models.CharField(max_length=100)
    price = models.DecimalField(max_digits=10, decimal_places=2)
    description = models.TextField(blank=True, default="")
    withdrawn_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return self.title
