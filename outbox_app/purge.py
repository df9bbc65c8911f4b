"""Purge: delete finished outbox rows older than the retention, in batches.

What goes, once older than ``OUTBOX_RETENTION_DAYS`` (or ``older_than_days``):

- SUCCEEDED (and SKIPPED) notifications completed before the cutoff;
- outbox events fanned out (``delivered``) and published before the cutoff
  whose every delivery finished before the cutoff (with those notifications);
- sentinel rows (actions that published nothing) created before the cutoff.

What never goes, however old: PENDING, RUNNING, FAILED and EXPIRED
notifications, and events that still have one of them, and events not fanned
out yet (a subscriber deployed later still gets them). Deleting everything older
than N days whatever its state loses undelivered events and the dead letter;
this module does not.

``manage.py outbox_purge`` and the Celery ``purge_outbox`` task call
:func:`purge`.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from .conf import outbox_settings
from .db import lock_waiting
from .models import Notification, OutboxEvent
from .states import FINISHED

DEFAULT_BATCH_SIZE = 1000


@dataclass
class PurgeCounts:
    """Rows deleted (or, in a dry run, that would be).

    Attributes:
        events: outbox events whose every delivery finished.
        notifications: SUCCEEDED notifications (those of the events above
            included).
        sentinels: sentinel rows of actions that published nothing.
    """

    events: int = 0
    notifications: int = 0
    sentinels: int = 0

    @property
    def total(self) -> int:
        return self.events + self.notifications + self.sentinels

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Purgeable:
    """The querysets of what a purge with ``cutoff`` deletes."""

    cutoff: datetime.datetime
    events: QuerySet
    notifications: QuerySet
    sentinels: QuerySet

    def counts(self) -> PurgeCounts:
        return PurgeCounts(
            events=self.events.count(),
            notifications=self.notifications.count(),
            sentinels=self.sentinels.count(),
        )


def cutoff_for(
    older_than_days: float | None = None, now: datetime.datetime | None = None
) -> datetime.datetime:
    """``now`` minus ``older_than_days`` (default ``OUTBOX_RETENTION_DAYS``).

    Raises:
        ValueError: a negative number of days.
    """
    days = (
        outbox_settings.RETENTION_DAYS if older_than_days is None else older_than_days
    )
    if days < 0:
        raise ValueError(f"older_than_days must be 0 or more, got {days!r}")
    return (now or timezone.now()) - datetime.timedelta(days=days)


def purgeable(cutoff: datetime.datetime, *, using: str = "default") -> Purgeable:
    """What a purge deletes at ``cutoff``, as querysets (nothing is evaluated)."""
    notifications = Notification.objects.using(using)
    finished = Q(state__in=FINISHED, completed_at__lt=cutoff)
    # A delivery that keeps its event: unfinished, or finished after the cutoff.
    keeps_event = notifications.filter(event=OuterRef("pk")).filter(
        ~Q(state__in=FINISHED)
        | Q(completed_at__isnull=True)
        | Q(completed_at__gte=cutoff)
    )
    events = OutboxEvent.objects.using(using)
    return Purgeable(
        cutoff=cutoff,
        events=events.filter(
            delivered=True, event_type__isnull=False, created_at__lt=cutoff
        ).filter(~Exists(keeps_event)),
        notifications=notifications.filter(finished),
        sentinels=events.sentinels().filter(created_at__lt=cutoff),
    )


def purge(
    older_than_days: float | None = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    progress: Callable[[PurgeCounts, PurgeCounts], None] | None = None,
    using: str = "default",
    now: datetime.datetime | None = None,
) -> PurgeCounts:
    """Delete finished rows older than the retention, ``batch_size`` at a time.

    Each batch is one short transaction, so a purge of millions of rows holds no
    long lock and can be interrupted and rerun at any time.

    Args:
        older_than_days: the retention in days; default ``OUTBOX_RETENTION_DAYS``.
        batch_size: rows per DELETE.
        dry_run: count what would be deleted, delete nothing.
        progress: called after each batch with ``(done, expected)``; ``expected``
            is counted once at the start.
        using: database alias.
        now: the clock (tests pass a fixed one).

    Returns:
        The rows deleted (or, with ``dry_run``, that would be).

    Raises:
        ValueError: a negative ``older_than_days`` or a ``batch_size`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be 1 or more, got {batch_size!r}")
    rows = purgeable(cutoff_for(older_than_days, now), using=using)
    expected = rows.counts()
    if dry_run:
        return expected
    done = PurgeCounts()

    def report() -> None:
        if progress is not None:
            progress(done, expected)

    report()

    def delete_events(ids: list) -> None:
        # Whole events: their (all SUCCEEDED) notifications go first. Both
        # statements re-check the condition, so a row requeued meanwhile stays.
        done.notifications += rows.notifications.filter(event_id__in=ids).delete()[0]
        deleted = rows.events.filter(pk__in=ids).only("pk").delete()[1]
        done.events += deleted.get(OutboxEvent._meta.label, 0)
        report()

    def delete_notifications(ids: list) -> None:
        # Old deliveries of events that stay (a sibling delivery is unfinished).
        done.notifications += rows.notifications.filter(pk__in=ids).delete()[0]
        report()

    def delete_sentinels(ids: list) -> None:
        deleted = rows.sentinels.filter(pk__in=ids).only("pk").delete()[1]
        done.sentinels += deleted.get(OutboxEvent._meta.label, 0)
        report()

    _in_batches(rows.events, batch_size, using, delete_events)
    _in_batches(rows.notifications, batch_size, using, delete_notifications)
    _in_batches(rows.sentinels, batch_size, using, delete_sentinels)
    return done


def _in_batches(
    queryset: QuerySet,
    batch_size: int,
    using: str,
    work: Callable[[list], None],
) -> None:
    """Call ``work(ids)`` on the ids of ``queryset``, ``batch_size`` at a time,
    each batch in one transaction with its rows locked.

    Keyset-paginated on the primary key, so rows ``work`` left in place are not
    read again.
    """
    base = lock_waiting(queryset.order_by("pk"))
    last = None
    while True:
        with transaction.atomic(using=using):
            page = base if last is None else base.filter(pk__gt=last)
            ids = list(page.values_list("pk", flat=True)[:batch_size])
            if not ids:
                return
            work(ids)
        last = ids[-1]
