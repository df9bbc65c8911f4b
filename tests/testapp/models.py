from django.db import models

from outbox_app.publishing.aggregates import RecordsEvents
from outbox_app.publishing.tracking import track

from .domain import Credited


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


class Category(models.Model):
    """Products' category: deleting one cascades to tracked products."""

    title = models.CharField(max_length=50)


@track(exclude=["notes"], soft_delete="deleted_at")
class Product(models.Model):
    """A tracked model (``@outbox_app.track``): every write publishes a change
    event."""

    name = models.CharField(max_length=50)
    price = models.DecimalField(max_digits=10, decimal_places=2)
    category = models.ForeignKey(
        Category, null=True, blank=True, on_delete=models.CASCADE
    )
    leaflet = models.FileField(blank=True, default="")
    notes = models.TextField(blank=True, default="")  # not tracked
    deleted_at = models.DateTimeField(null=True, blank=True)


class Account(RecordsEvents, models.Model):
    """An aggregate recording domain events (``outbox_app.publishing.aggregates``)."""

    owner = models.CharField(max_length=50)
    balance = models.DecimalField(max_digits=10, decimal_places=2, default=0)
    version = models.PositiveIntegerField(default=0)

    outbox_version_field = "version"

    def credit(self, amount, event_class=Credited) -> None:
        self.balance += amount
        self.record(event_class(amount=amount))


class GadgetQuerySet(models.QuerySet):
    """A custom queryset: tracking mixes in after it, its methods stay."""

    def cheap(self):
        return self.filter(price__lt=5)


def fallback_category():
    """Where a gadget's ``backup`` goes when its category is deleted."""
    return Category.objects.get_or_create(title="fallback")[0].pk


@track(
    aggregate_type="Gadget",
    soft_delete="removed_at",
    names={"soft_delete": "Deleted", "delete": "ForceDeleted"},
)
class Gadget(models.Model):
    """A tracked model named as its subscribers know it: aggregate type
    ``Gadget``, a soft delete published as ``GadgetDeleted`` and a delete for
    good as ``GadgetForceDeleted``."""

    name = models.CharField(max_length=50)
    price = models.DecimalField(max_digits=8, decimal_places=2, default=0)
    launched = models.DateField(null=True, blank=True)
    touched = models.DateTimeField(auto_now=True)
    removed_at = models.DateTimeField(null=True, blank=True)
    # What deleting a category does to its gadgets: each on_delete that
    # changes them (SET_NULL, SET_DEFAULT, SET) publishes their update.
    category = models.ForeignKey(
        Category, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    shelf = models.ForeignKey(
        Category,
        null=True,
        blank=True,
        default=None,
        on_delete=models.SET_DEFAULT,
        related_name="+",
    )
    backup = models.ForeignKey(
        Category,
        null=True,
        blank=True,
        on_delete=models.SET(fallback_category),
        related_name="+",
    )

    objects = GadgetQuerySet.as_manager()


class GadgetProxy(Gadget):
    """A proxy of a tracked model: its writes publish as Gadget's."""

    class Meta:
        proxy = True


class SmartGadget(Gadget):
    """A multi-table child of a tracked model (untracked itself): writes of
    the parent's fields publish as Gadget's."""

    firmware = models.CharField(max_length=20, default="1.0")
