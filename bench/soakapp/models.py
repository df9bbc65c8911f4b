from django.db import models


class Deposit(models.Model):
    """The writer's own row, committed in the same transaction as the event
    it publishes (one per event): the soak checks that the two sets match."""

    event_id = models.UUIDField(unique=True)
    account = models.CharField(max_length=100)
    version = models.IntegerField()


class Effect(models.Model):
    """A handler's database write, in the transaction that delivers it (marks
    its row SUCCEEDED, or moves its cursor past it). Deliberately no unique
    constraint: a second delivery would add a second row, which the soak
    counts."""

    handler = models.CharField(max_length=100)
    event_id = models.UUIDField()
    aggregate = models.CharField(max_length=100, blank=True, default="")
    position = models.IntegerField(null=True)
    #: Ordered handler only: the highest position of the aggregate's effects
    #: that the handler saw committed when it ran (0 for none).
    previous = models.IntegerField(null=True)
    attempt = models.IntegerField()
    relay_pid = models.IntegerField()
    #: When the handler wrote it, by the database's clock (as the event's
    #: ``occurred_at``): the soak's witness of publish() -> handled, whichever
    #: delivery engine ran it.
    at = models.DateTimeField(null=True)

    class Meta:
        indexes = [
            models.Index(fields=["handler", "event_id"], name="soak_effect_event"),
            models.Index(
                fields=["handler", "aggregate", "position"], name="soak_effect_order"
            ),
        ]


class Sent(models.Model):
    """What ``soak.callback``'s ``on_commit`` callback sends, once per event:
    the unique key makes the callback idempotent, as a handler whose side
    effect runs after its commit must be (it runs again when the callback
    fails)."""

    event_id = models.UUIDField(unique=True)
    attempt = models.IntegerField()
    #: When the callback sent it, by the database's clock.
    at = models.DateTimeField(null=True)
