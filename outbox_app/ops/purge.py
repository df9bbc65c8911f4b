"""Purge: delete finished outbox rows older than the retention, in batches.

What goes, once older than ``OUTBOX_RETENTION_DAYS`` (or ``older_than_days``):

- SUCCEEDED (and SKIPPED) deliveries completed before the cutoff;
- outbox events fanned out (``fanned_out``) and published before the cutoff
  whose every delivery finished before the cutoff (with those deliveries);
- sentinel rows (actions that published nothing) created before the cutoff;
- the inbox's HANDLED rows (``manage.py consume``) handled more than
  ``OUTBOX_INBOX_RETENTION_DAYS`` ago (a duplicate of such a message arriving
  later runs its consumer again); FAILED and DEAD inbox rows never go.

What never goes, however old: PENDING, RUNNING, FAILED and DEAD
deliveries, and events that still have one of them, and events not fanned
out yet (a subscriber deployed later still gets them). Deleting everything older
than N days whatever its state loses events awaiting fan-out and the dead letter;
this module does not.

``manage.py outbox_purge`` and the Celery ``purge_outbox`` task call
:func:`purge`.

How it deletes tens of millions of rows beside a running relay (measured:
docs/operations.md, "outbox_purge"):

- **Pages by primary key, read without locks.** Each pass reads the next
  ``batch_size`` ids after the last one (``id > last ORDER BY id LIMIT n``)
  with a plain read, outside any transaction. No ``SELECT ... FOR UPDATE``: on
  MariaDB (REPEATABLE READ) a locking read locks every record and gap it
  scans, and a pass's last page scans into the relay's fresh rows.
- **The events' pages use the cheap condition only** (fanned out, old). With
  "no delivery keeps it" in the page query, PostgreSQL plans ``LIMIT n`` as a
  merge anti-join that walks the deliveries' ``(event, subscriber)`` index
  from its start at every page: 1.3 s a page at 2 million deliveries, and
  growing with the table. That test is applied by the events' DELETE, which
  names its ids (index probes).
- **One short transaction per batch, DELETEs by key.** The deliveries of
  the page's events (the unique ``(event, subscriber)`` index), then the
  events (primary key), each one ``DELETE`` that re-checks the condition, so
  a row requeued meanwhile stays. The purge locks only old rows, which the
  relay never claims; no transaction outlives a batch, and every committed
  batch stays done if the purge is stopped.
- **A pause after each batch** (``pause_ratio`` times the batch's duration,
  1 by default: the purge works at most half the time), longer while the
  relays have work waiting (``busy_pause_ratio``, 4 by default: at most a
  fifth of the time; checked at most once a second, with two index probes),
  so the relay keeps >= 0.8x its delivery rate while a purge runs
  (at ratio 1 throughout, MariaDB's relay kept only 0.76x beside a
  5-million-event purge: docs/operations.md, "outbox_purge").
"""

from __future__ import annotations

import dataclasses
import datetime
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet

from ..conf import outbox_settings
from ..store.clock import database_now
from ..store.lifecycle import FINISHED, InboxState
from ..store.models import Delivery, InboxMessage, OutboxEvent
from ..store.querysets import keyset_pages
from ..store.sql import dialect

DEFAULT_BATCH_SIZE = 1000
#: After each batch, sleep this many times as long as the batch took.
DEFAULT_PAUSE_RATIO = 1.0
#: The same while relays have work waiting (due deliveries, events awaiting
#: fan-out): the purge yields to them.
DEFAULT_BUSY_PAUSE_RATIO = 4.0
#: Seconds between two looks at whether the relays have work waiting.
BUSY_CHECK_SECONDS = 1.0


@dataclass
class PurgeCounts:
    """Rows deleted (or, in a dry run, that would be).

    Attributes:
        events: outbox events whose every delivery finished.
        deliveries: SUCCEEDED deliveries (those of the events above
            included).
        sentinels: sentinel rows of actions that published nothing.
        inbox: HANDLED inbox rows past the inbox's retention.
    """

    events: int = 0
    deliveries: int = 0
    sentinels: int = 0
    inbox: int = 0

    @property
    def total(self) -> int:
        return self.events + self.deliveries + self.sentinels + self.inbox

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Purgeable:
    """The querysets of what a purge with ``cutoff`` (``inbox_cutoff`` for
    the inbox) deletes."""

    cutoff: datetime.datetime
    events: QuerySet
    deliveries: QuerySet
    sentinels: QuerySet
    inbox: QuerySet

    def counts(self) -> PurgeCounts:
        return PurgeCounts(
            events=self.events.count(),
            deliveries=self.deliveries.count(),
            sentinels=self.sentinels.count(),
            inbox=self.inbox.count(),
        )


def cutoff_for(
    older_than_days: float | None = None,
    now: datetime.datetime | None = None,
    using: str = "default",
) -> datetime.datetime:
    """``now`` (default: the clock of database ``using``) minus
    ``older_than_days`` (default ``OUTBOX_RETENTION_DAYS``).

    Raises:
        ValueError: a negative number of days.
    """
    days = (
        outbox_settings.RETENTION_DAYS if older_than_days is None else older_than_days
    )
    if days < 0:
        raise ValueError(f"older_than_days must be 0 or more, got {days!r}")
    return (now or database_now(using)) - datetime.timedelta(days=days)


def purgeable(
    cutoff: datetime.datetime,
    *,
    using: str = "default",
    inbox_cutoff: datetime.datetime | None = None,
) -> Purgeable:
    """What a purge deletes at ``cutoff`` (the inbox's HANDLED rows at
    ``inbox_cutoff``, default ``OUTBOX_INBOX_RETENTION_DAYS`` ago), as
    querysets (nothing is evaluated)."""
    if inbox_cutoff is None:
        inbox_cutoff = database_now(using) - datetime.timedelta(
            days=outbox_settings.INBOX_RETENTION_DAYS
        )
    deliveries = Delivery.objects.using(using)
    finished = Q(state__in=FINISHED, completed_at__lt=cutoff)
    # A delivery that keeps its event: unfinished, or finished after the cutoff.
    keeps_event = deliveries.filter(event=OuterRef("pk")).filter(
        ~Q(state__in=FINISHED)
        | Q(completed_at__isnull=True)
        | Q(completed_at__gte=cutoff)
    )
    events = _old_events(cutoff, using).filter(~Exists(keeps_event))
    # Stream delivery: a cursor still to read it keeps it too.
    d = dialect(using)
    table = d.quote(OutboxEvent._meta.db_table)
    events = events.extra(where=[f"NOT {d.awaited(table)}"])
    return Purgeable(
        cutoff=cutoff,
        events=events,
        deliveries=deliveries.filter(finished),
        sentinels=OutboxEvent.objects.using(using)
        .sentinels()
        .filter(created_at__lt=cutoff),
        inbox=InboxMessage.objects.using(using).filter(
            state=InboxState.HANDLED, handled_at__lt=inbox_cutoff
        ),
    )


def _old_events(cutoff: datetime.datetime, using: str) -> QuerySet:
    """Events fanned out (or written for stream delivery) before ``cutoff``,
    whatever their deliveries."""
    return OutboxEvent.objects.using(using).filter(
        Q(fanned_out=True) | Q(fanned_out__isnull=True),
        event_type__isnull=False,
        created_at__lt=cutoff,
    )


def purge(
    older_than_days: float | None = None,
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    dry_run: bool = False,
    pause_ratio: float = DEFAULT_PAUSE_RATIO,
    busy_pause_ratio: float = DEFAULT_BUSY_PAUSE_RATIO,
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
        pause_ratio: after each batch, sleep ``pause_ratio`` times as long as
            the batch took (1: the purge works at most half the time; 0: no
            pause), so the relay keeps its share of the database and the CPU.
        busy_pause_ratio: the same while the relays have work waiting (due
            deliveries or events awaiting fan-out); never below
            ``pause_ratio``.
        progress: called after each batch with ``(done, expected)``; ``expected``
            is counted once at the start.
        using: database alias.
        now: the clock (tests pass a fixed one).

    Returns:
        The rows deleted (or, with ``dry_run``, that would be).

    Raises:
        ValueError: a negative ``older_than_days``, ``pause_ratio`` or
            ``busy_pause_ratio``, or a ``batch_size`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be 1 or more, got {batch_size!r}")
    if pause_ratio < 0 or busy_pause_ratio < 0:
        raise ValueError(
            "pause_ratio and busy_pause_ratio must be 0 or more, got "
            f"{pause_ratio!r} and {busy_pause_ratio!r}"
        )
    inbox_cutoff = (now or database_now(using)) - datetime.timedelta(
        days=outbox_settings.INBOX_RETENTION_DAYS
    )
    rows = purgeable(
        cutoff_for(older_than_days, now, using),
        using=using,
        inbox_cutoff=inbox_cutoff,
    )
    expected = rows.counts()
    if dry_run:
        return expected
    done = PurgeCounts()

    def report() -> None:
        if progress is not None:
            progress(done, expected)

    report()

    def delete_events(ids: list) -> None:
        # Old events: their finished old deliveries go first (those of an
        # event that stays too: the deliveries' pass would delete them),
        # then the events with no delivery left that keeps them. Each DELETE
        # names its rows by primary key and re-checks the condition, so a row
        # requeued meanwhile stays; one statement each, no collector (which
        # would SELECT the rows and DELETE them again).
        done.deliveries += _delete(rows.deliveries.filter(event_id__in=ids))
        done.events += _delete(rows.events.filter(pk__in=ids))
        report()

    def delete_deliveries(ids: list) -> None:
        # Old deliveries of events that stay (a sibling delivery is unfinished).
        done.deliveries += _delete(rows.deliveries.filter(pk__in=ids))
        report()

    def delete_sentinels(ids: list) -> None:
        # Sentinels are never fanned out: no delivery refers to them.
        done.sentinels += _delete(rows.sentinels.filter(pk__in=ids))
        report()

    def delete_inbox(ids: list) -> None:
        # Handled messages only: the DELETE re-checks, so a row requeued
        # meanwhile stays. Consumers insert new rows and never wait on these.
        done.inbox += _delete(rows.inbox.filter(pk__in=ids))
        report()

    pause = _Pause(using, pause_ratio, max(pause_ratio, busy_pause_ratio))

    # The events' pages are read without the "every delivery finished" test:
    # with it, PostgreSQL plans LIMIT n as a merge anti-join that walks the
    # deliveries' (event, subscriber) index from its start at every page
    # (1.3 s a page at 2 million deliveries, growing with the table);
    # delete_events applies the test to its page of ids instead.
    for queryset, work in (
        (_old_events(rows.cutoff, using), delete_events),
        (rows.deliveries, delete_deliveries),
        (rows.sentinels, delete_sentinels),
        (rows.inbox, delete_inbox),
    ):
        _in_batches(queryset, batch_size, using, work, pause)
    return done


def _delete(queryset: QuerySet) -> int:
    """One ``DELETE ... WHERE <the queryset's filter>``: rows deleted."""
    return queryset._raw_delete(queryset.db)


class _Pause:
    """How long to sleep after a batch: ``ratio`` times its duration, or
    ``busy_ratio`` times while the relays have work waiting (looked at no more
    than once every ``BUSY_CHECK_SECONDS``)."""

    def __init__(self, using: str, ratio: float, busy_ratio: float) -> None:
        self.using, self.ratio, self.busy_ratio = using, ratio, busy_ratio
        self.busy = False
        self.checked = -BUSY_CHECK_SECONDS

    def __call__(self, worked: float) -> None:
        ratio = self.ratio
        if self.busy_ratio > self.ratio:
            if time.monotonic() - self.checked >= BUSY_CHECK_SECONDS:
                self.checked = time.monotonic()
                self.busy = (
                    Delivery.objects.using(self.using).due().exists()
                    or OutboxEvent.objects.using(self.using).awaiting_fanout().exists()
                )
            if self.busy:
                ratio = self.busy_ratio
        if ratio:
            time.sleep(worked * ratio)


def _in_batches(
    queryset: QuerySet,
    batch_size: int,
    using: str,
    work: Callable[[list], None],
    pause: Callable[[float], None] | None = None,
) -> None:
    """Call ``work(ids)`` on the ids of ``queryset``, ``batch_size`` at a time,
    each batch in its own short transaction.

    The ids are read without a lock (a plain MVCC read, outside the batch's
    transaction) and keyset-paginated on the primary key, so rows ``work`` left
    in place are not read again and no scan holds a lock; ``work``'s DELETEs
    lock only the rows they name by primary key and re-check the condition.
    After each batch it calls ``pause`` with the seconds the batch took.
    """
    began = time.monotonic()
    for ids in keyset_pages(queryset.values_list("pk", flat=True), batch_size):
        with transaction.atomic(using=using):
            work(ids)
        if pause is not None:
            pause(time.monotonic() - began)
        began = time.monotonic()
