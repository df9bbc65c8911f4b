from django.db import models


class Order(models.Model):
    """An aggregate the tests publish events about."""

    reference = models.CharField(max_length=50)
    total = models.DecimalField(max_digits=10, decimal_places=2, default=0)


class SideEffect(models.Model):
    """A handler's database write; unique, so a second delivery would clash."""

    handler = models.CharField(max_length=100)
    event_id = models.UUIDField()
    position = models.IntegerField(null=True)
    aggregate = models.CharField(max_length=100, blank=True, default="")
    seen_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.UniqueConstraint(
                fields=["handler", "event_id"], name="testapp_side_effect_once"
            )
        ]
