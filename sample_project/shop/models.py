from django.db import models


class Order(models.Model):
    customer_email = models.EmailField()
    total = models.DecimalField(max_digits=10, decimal_places=2)
    placed_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return f"Order #{self.pk} ({self.customer_email})"


class ConfirmationEmail(models.Model):
    """Written by the OrderPlaced handler: one per order, exactly once."""

    order = models.OneToOneField(Order, on_delete=models.CASCADE)
    sent_at = models.DateTimeField(auto_now_add=True)
