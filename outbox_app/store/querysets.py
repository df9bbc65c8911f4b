"""Predicates and operators' state transitions of the outbox tables.

The admin, the management commands and the Celery tasks call these methods and
never update a row themselves. The relay's own transitions (claim, renew,
succeed, fail, release) are raw statements in
:mod:`outbox_app.store.gateway`, the hot path's only sender of SQL.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator

from django.db import models, transaction
from django.db.models import Case, F, Q, QuerySet, Value, When
from django.db.models.functions import Coalesce

from ..events.ids import worker_name
from ..events.text import storable
from ..exceptions import SubscriptionInUse, UnknownTransition
from .clock import database_now
from .db import insert_select, reissued_on_deadlock, unless_waiting
from .lifecycle import (
    ABANDONABLE,
    CLAIMABLE,
    DEAD_LETTERABLE,
    INBOX,
    INBOX_REQUEUEABLE,
    REQUEUEABLE,
    RETRYABLE,
    SKIPPABLE,
    InboxState,
    State,
    transition,
)
from .tables import COPIED_COLUMNS


class OutboxEventQuerySet(QuerySet):
    def for_tenant(self, tenant_id: str | None) -> OutboxEventQuerySet:
        """Events of one tenant only (``None``: the events of no tenant)."""
        return self.filter(tenant_id=tenant_id)

    def sentinels(self) -> OutboxEventQuerySet:
        """Rows recording an action that published nothing."""
        return self.filter(event_type__isnull=True)

    def awaiting_fanout(self) -> OutboxEventQuerySet:
        """Events not fanned out yet (sentinels excluded)."""
        return self.filter(fanned_out=False, event_type__isnull=False)


class DeliveryQuerySet(QuerySet):
    # --- predicates -------------------------------------------------------------

    def for_subscribers(self, names: Iterable[str]) -> DeliveryQuerySet:
        return self.filter(subscriber__in=list(names))

    def due(self, now: datetime.datetime | None = None) -> DeliveryQuerySet:
        """Rows a claim may take at ``now`` (default: the database's clock,
        :func:`~outbox_app.store.clock.database_now`): PENDING or FAILED whose retry
        time has come, and RUNNING rows whose lease ran out."""
        return self.filter(
            state__in=CLAIMABLE, next_retry_at__lte=now or database_now(self.db)
        )

    def scheduled(self, now: datetime.datetime | None = None) -> DeliveryQuerySet:
        """Rows scheduled for later: PENDING, their event's ``deliver_at``
        still ahead of ``now`` (default: the database's clock). Waiting on
        purpose: not lag."""
        return self.filter(_scheduled(now or database_now(self.db)))

    def blocked_aggregates(self) -> int:
        """How many (subscriber, aggregate) pairs are stuck: each has an
        DEAD row, which holds back the pair's later rows until an operator
        requeues or skips it. Each pair counts once, however many of its rows
        are DEAD or wait behind them; rows without an aggregate hold
        nothing back and are not counted.

        An ordered subscriber's aggregates follow publish order
        (``position``, a total order), so a pair stops for good only behind
        a DEAD row: a FAILED head is retried, a RUNNING one's lease runs
        out, a scheduled one comes due, an event waiting for fan-out is
        fanned out. Meaningful on ordered subscribers' rows: call it on
        ``for_subscribers(ordered_names)``.
        """
        return (
            self.filter(state=State.DEAD, aggregate_id__isnull=False)
            .order_by()
            .values("subscriber", "aggregate_type", "aggregate_id")
            .distinct()
            .count()
        )

    # --- fan-out ---------------------------------------------------------------------

    def create_for(
        self, events: QuerySet, subscriber: str, now: datetime.datetime
    ) -> int:
        """Create a PENDING delivery to ``subscriber``, due at ``now`` (a
        scheduled event's at its ``deliver_at``), for each event of ``events``
        that has none yet: one ``INSERT ... SELECT``.

        The event's columns fan-out copies (``tables.COPIED_COLUMNS``; ``id`` into
        ``event_id``); every other column takes the model's default. Returns
        rows created.
        """
        model = self.model
        template = model(
            subscriber=subscriber, next_retry_at=now, created_at=now, updated_at=now
        )
        copied = {
            ("event_id" if name == "id" else name): name for name in COPIED_COLUMNS
        }
        columns = {
            field.column: F(copied[field.attname])
            if field.attname in copied
            else Coalesce("deliver_at", Value(now, output_field=field))
            if field.attname == "next_retry_at"
            else Value(getattr(template, field.attname), output_field=field)
            for field in model._meta.concrete_fields
            if not field.primary_key  # numbered by the database
        }
        return insert_select(model, columns, events.using(self.db).order_by("id"))

    # --- operators' transitions ---------------------------------------------------

    #: The operator's transitions :meth:`apply` runs, by their name in
    #: :data:`~outbox_app.store.lifecycle.DELIVERY`.
    OPERATOR_TRANSITIONS = ("requeue", "retry_now", "dead_letter", "skip")

    def of_events(self, events: QuerySet) -> DeliveryQuerySet:
        """The deliveries of the outbox events ``events`` (any filter)."""
        return self.filter(event__in=events.values("id"))

    def affected(self, name: str) -> DeliveryQuerySet:
        """The rows the operator's transition ``name`` would change: those in
        its sources (the rest are left alone).

        Raises:
            UnknownTransition: ``name`` is not an operator's transition.
        """
        if name not in self.OPERATOR_TRANSITIONS:
            raise UnknownTransition(f"unknown transition {name!r}")
        return self.filter(state__in=transition(name).sources)

    def apply(self, name: str, *, batch_size: int = 1000, dry_run: bool = False) -> int:
        """Run the operator's transition ``name`` (``"requeue"``,
        ``"retry_now"``, ``"dead_letter"`` or ``"skip"``) on these rows, in
        batches of ``batch_size`` (ordering and slicing are ignored), so it
        behaves the same on ten rows and on a million: the admin's "Requeue
        all matching" on 100,000 rows holds one batch of ids at a time.

        Returns:
            Rows changed (with ``dry_run``: that would be; nothing changes).

        Raises:
            UnknownTransition: ``name`` is not an operator's transition.
        """
        rows = self.affected(name)  # refuses an unknown name
        if dry_run:
            return rows.count()
        return getattr(self, name)(batch_size)

    def requeue(self, batch_size: int = 1000) -> int:
        """FAILED/DEAD -> PENDING, due now (a scheduled event's row: at its
        ``deliver_at`` while it is ahead), attempts reset to 0.

        The last error, its type and traceback and ``first_failed_at`` are kept,
        as history, until the next attempt overwrites or succeeds. Works in
        batches of ``batch_size`` rows, so requeueing 100,000 rows never loads
        them into memory nor holds one long lock. Returns rows requeued.
        "Now" is the database's clock (:func:`~outbox_app.store.clock.database_now`),
        as for every operator action here.
        """
        now = database_now(self.db)
        return self._in_batches(
            self.filter(state__in=REQUEUEABLE),
            batch_size,
            state=State.PENDING,
            attempts=0,
            next_retry_at=_due(now),
            completed_at=None,
            updated_at=now,
        )

    def retry_now(self, batch_size: int = 1000) -> int:
        """Make FAILED rows due now, keeping their attempt count."""
        now = database_now(self.db)
        return self._in_batches(
            self.filter(state__in=RETRYABLE),
            batch_size,
            next_retry_at=now,
            updated_at=now,
        )

    def dead_letter(self, batch_size: int = 1000) -> int:
        """Stop retrying: PENDING/FAILED -> DEAD (RUNNING rows are left to
        their worker)."""
        now = database_now(self.db)
        return self._in_batches(
            self.filter(state__in=DEAD_LETTERABLE),
            batch_size,
            state=State.DEAD,
            completed_at=now,
            updated_at=now,
        )

    def skip(self, batch_size: int = 1000, states=SKIPPABLE) -> int:
        """Give up delivering: FAILED/DEAD (or ``states``) -> SKIPPED,
        finished, the error kept. An ordered subscriber's aggregate held back
        by the row flows on."""
        now = database_now(self.db)
        return self._in_batches(
            self.filter(state__in=states),
            batch_size,
            state=State.SKIPPED,
            completed_at=now,
            updated_at=now,
        )

    def abandon(self, batch_size: int = 1000) -> int:
        """What waits for a subscription retired with ``waiting="skip"``
        (the lifecycle's ``abandon``): PENDING, FAILED and DEAD -> SKIPPED,
        in batches; RUNNING rows are left to the relay that leased them.
        Returns rows skipped."""
        return self.skip(batch_size, states=ABANDONABLE)

    def replay(self, now: datetime.datetime | None = None) -> int:
        """Deliver again: every row but RUNNING ones and scheduled ones not
        due yet (PENDING: they are delivered when due) -> PENDING, due now,
        attempts reset (the last error kept as history). Returns rows reset."""
        now = now or database_now(self.db)
        return self.exclude(Q(state=State.RUNNING) | _scheduled(now)).update(
            state=State.PENDING,
            attempts=0,
            next_retry_at=_due(now),
            completed_at=None,
            locked_until=None,
            lease_token=None,
            locked_by="",
            updated_at=now,
        )

    def _in_batches(self, queryset: QuerySet, batch_size: int, **fields) -> int:
        return in_batches(queryset, batch_size, **fields)


def in_batches(queryset: QuerySet, batch_size: int, **fields) -> int:
    """``queryset.update(**fields)`` in batches of ``batch_size`` rows
    (:func:`keyset_pages`), each batch re-filtered by ``queryset``, so a row
    that changed meanwhile is left alone. Returns rows updated."""
    total = 0
    for ids in keyset_pages(queryset.values_list("pk", flat=True), batch_size):
        total += queryset.filter(pk__in=ids).update(**fields)
    return total


def keyset_pages(queryset: QuerySet, size: int) -> Iterator[list]:
    """``queryset``'s rows in pages of ``size``, in primary key order, each page
    read after the previous one's last key (never ``OFFSET``): rows the caller
    changes or deletes between pages are not read again, a page costs the same
    at the millionth row as at the first, and no read holds a lock.

    Args:
        queryset: model instances, or primary keys
            (``values_list("pk", flat=True)``); its ordering is replaced.
        size: rows per page.

    Yields:
        Lists of up to ``size`` rows, as ``queryset`` gives them.
    """
    base = queryset.order_by("pk")
    last = None
    while True:
        page = list((base if last is None else base.filter(pk__gt=last))[:size])
        if not page:
            return
        yield page
        last = page[-1].pk if isinstance(page[-1], models.Model) else page[-1]


class SubscriberPauseQuerySet(QuerySet):
    def record(self, subscriber: str, pause, resumed_at) -> None:
        """Write a relay's pause of ``subscriber`` (a
        :class:`outbox_app.relay.sending.Pause`), ``resumed_at`` set when
        a probe succeeded."""
        self.update_or_create(
            subscriber=subscriber,
            defaults={
                "paused_at": pause.since,
                "resume_at": pause.resume_at,
                "resumed_at": resumed_at,
                "probes": pause.probes,
                "reason": storable(pause.reason)[:2000],
                "worker": worker_name(),
                "updated_at": database_now(self.db),
            },
        )

    def paused(self, now: datetime.datetime | None = None) -> SubscriberPauseQuerySet:
        """Pauses still on: not resumed, and probed recently enough that a relay
        is still at it (a relay that stopped while paused leaves its row)."""
        from ..conf import outbox_settings

        now = now or database_now(self.db)
        stale = datetime.timedelta(seconds=2 * outbox_settings.PAUSE_MAX_SECONDS + 60)
        return self.filter(resumed_at__isnull=True, resume_at__gte=now - stale)


#: How ``retired_by`` of a subscription retired by a narrowing of its
#: subscriber's event types starts (``SubscriptionQuerySet.record``).
NARROWED = "event types narrowed"
#: How often a relay refreshes ``last_seen_at`` on the subscriptions it has.
HEARTBEAT_SECONDS = 60
#: A subscription no relay has refreshed for this long has no relay serving it
#: (the overview, ``outbox_status`` and ``outbox_subscribers`` say so, and
#: ``--retire`` needs no ``--force``).
SERVED_SECONDS = 5 * HEARTBEAT_SECONDS


def served_since(
    now: datetime.datetime | None = None, using: str | None = None
) -> datetime.datetime:
    """A subscription refreshed at or after this moment has a relay serving it
    (``now`` default: the clock of database ``using``)."""
    return (now or database_now(using)) - datetime.timedelta(seconds=SERVED_SECONDS)


#: A subscription refreshed within this long has a relay serving it now: a
#: running relay refreshes it every :data:`HEARTBEAT_SECONDS`, so two missed
#: refreshes mean none is running. Between this and :data:`SERVED_SECONDS` it
#: is "stale": still counted as served where that protects (``--retire``
#: needs ``--force``), shown as not served now.
SERVING_SECONDS = 2 * HEARTBEAT_SECONDS


def serving(
    retired_at: datetime.datetime | None,
    last_seen_at: datetime.datetime,
    now: datetime.datetime,
) -> str:
    """Whether a process serves a subscription (or a consumer's): "retired",
    "serving" (refreshed within :data:`SERVING_SECONDS`), "stale" (within
    :data:`SERVED_SECONDS`) or "unserved"."""
    if retired_at is not None:
        return "retired"
    age = (now - last_seen_at).total_seconds()
    if age <= SERVING_SECONDS:
        return "serving"
    return "stale" if age <= SERVED_SECONDS else "unserved"


#: What ``waiting`` may say when subscriptions are retired: give up what waits
#: for their subscriber (``"skip"``) or leave it for a process that still has
#: the subscriber (``"keep"``).
RETIRE_WAITING = ("skip", "keep")


class SubscriptionQuerySet(QuerySet):
    #: What refreshes these rows while it runs (as :class:`~outbox_app.
    #: exceptions.SubscriptionInUse` names it).
    process = "relay"
    #: The field naming the subscriber, here and on the rows that wait for it.
    name_field = "subscriber"
    #: The model of the rows that wait for a subscriber, and the transition
    #: (by ``"retire"``) a retire with ``waiting="skip"`` makes of them: a
    #: method of its queryset, ``(batch_size) -> rows changed``.
    waiting_model = "Delivery"
    waiting_transition = "abandon"

    def active(self) -> SubscriptionQuerySet:
        return self.filter(retired_at__isnull=True)

    def retire_and_settle(
        self,
        *,
        waiting: str,
        by: str,
        force: bool = False,
        batch_size: int = 1000,
        hand_over: Callable[[list[tuple[str, str]]], int] | None = None,
    ) -> tuple[int, int]:
        """Retire these subscriptions as an operator does (``manage.py
        outbox_subscribers --retire``, the admin's actions): in one
        transaction, lock the active rows, refuse them if a running process
        refreshed one within :data:`SERVED_SECONDS` (unless ``force``), and
        retire them; then settle what waits for their subscribers: with
        ``waiting="skip"`` the retire transition of their lifecycle table
        (:attr:`waiting_transition`: a delivery's ``abandon``, SKIPPED; an
        inbox message's ``dead_letter``, DEAD: the inbox has no SKIPPED),
        with ``"keep"`` left for a process that still has the subscriber.
        Retired rows among these are left alone.

        Args:
            waiting: one of :data:`RETIRE_WAITING`.
            by: who retires them, stored as ``retired_by`` (``"admin:
                alice"``; cut to 255 characters).
            force: retire even rows a running process still refreshes.
            batch_size: waiting rows changed per UPDATE.
            hand_over: called in the transaction, before the rows are
                retired, with their ``(subscriber, event type)`` pairs;
                returns how many waiting rows it settled (stream delivery
                hands over what its cursors have not read:
                :func:`~outbox_app.ops.streams.hand_over`).

        Returns:
            ``(subscriptions retired, waiting rows settled)``: skipped
            deliveries, or dead-lettered inbox messages.

        Raises:
            SubscriptionInUse: a running process refreshed one of them within
                :data:`SERVED_SECONDS` and ``force`` is not set; nothing is
                changed.
            ValueError: ``waiting`` is not one of :data:`RETIRE_WAITING`.
        """
        from ..subscribers import WILDCARD

        if waiting not in RETIRE_WAITING:
            raise ValueError(
                f"waiting must be one of {RETIRE_WAITING}, not {waiting!r}"
            )
        with transaction.atomic(using=self.db):
            rows = self.active().select_for_update()
            served = sorted(rows.served(), key=str)
            if served and not force:
                now = database_now(self.db)
                raise SubscriptionInUse(
                    self.process,
                    [
                        (
                            str(row),
                            (now - row.last_seen_at).total_seconds(),
                            row.last_seen_by,
                        )
                        for row in served
                    ],
                    SERVED_SECONDS // 60,
                )
            pairs = list(rows.values_list(self.name_field, "event_type"))
            settled = hand_over(pairs) if hand_over else 0
            retired = rows.retire(by[:255])
        if waiting == "skip" and pairs:
            match = Q()
            for name, event_type in pairs:
                match |= Q(**{self.name_field: name}) & (
                    Q() if event_type == WILDCARD else Q(event_type=event_type)
                )
            model = self.model._meta.apps.get_model(
                self.model._meta.app_label, self.waiting_model
            )
            waits = model._default_manager.using(self.db).filter(match)
            settled += getattr(waits, self.waiting_transition)(batch_size)
        return retired, settled

    def served(self, now: datetime.datetime | None = None) -> SubscriptionQuerySet:
        """Active rows a relay refreshed within :data:`SERVED_SECONDS`."""
        return self.active().filter(last_seen_at__gte=served_since(now, self.db))

    def unserved(self, now: datetime.datetime | None = None) -> SubscriptionQuerySet:
        """Active rows no relay refreshed within :data:`SERVED_SECONDS`: their
        deliveries wait for a relay that has the subscriber."""
        return self.active().filter(last_seen_at__lt=served_since(now, self.db))

    def record(
        self,
        subscribers: Iterable,
        worker: str,
        now: datetime.datetime | None = None,
        heartbeat: bool = True,
        started: bool = False,
    ) -> None:
        """Record that a process has ``subscribers`` (:class:`~outbox_app.
        subscribers.Subscriber` values): one row per subscriber and event type
        (``*``: every type), inserted if missing (a retired row stays retired),
        ``last_seen_at`` refreshed when older than :data:`HEARTBEAT_SECONDS`
        (with ``heartbeat``); the rows of a subscriber's ``aliases`` (its
        former names) are retired, so a renamed subscriber is not fanned out
        to twice.

        With ``started`` (a relay's first record, ``outbox_subscribers
        --record``) the process's event types win: a live row of one of its
        subscribers for a type it no longer takes is retired (its
        ``EVENT_TYPES`` were narrowed; ``retired_by`` starts with
        :data:`NARROWED`), and a row such a narrowing retired comes back
        when the type is taken again. An operator's retire is left alone,
        and so are older relays' heartbeats: the newest start decides."""
        reissued_on_deadlock(
            self.db,
            lambda: self._record(list(subscribers), worker, now, heartbeat, started),
            "recording subscriptions",
        )

    def _record(self, subscribers, worker, now, heartbeat, started=False) -> None:
        # Relays starting side by side insert the same rows: on MariaDB two
        # INSERT IGNOREs of one key can deadlock (a shared lock on the
        # duplicate, then each waits to insert), so the caller reissues.
        from ..subscribers import WILDCARD

        now = now or database_now(self.db)
        rows = [
            self.model(
                subscriber=s.name,
                event_type=t,
                kind=s.kind,
                ordered=s.ordered,
                first_seen_at=now,
                last_seen_at=now,
                last_seen_by=worker[:255],
            )
            for s in subscribers
            for t in sorted(s.event_types or (WILDCARD,))
        ]
        self._seen(rows, ["subscriber", "event_type"], worker, now, heartbeat)
        self._ensure_cursors(subscribers, now)
        aliases = {a: s.name for s in subscribers for a in s.aliases}
        for alias, name in aliases.items():
            self.active().filter(subscriber=alias).update(
                retired_at=now, retired_by=f"renamed to {name}"[:255]
            )
        if started:
            for s in subscribers:
                taken = sorted(s.event_types or (WILDCARD,))
                self.active().filter(subscriber=s.name).exclude(
                    event_type__in=taken
                ).update(retired_at=now, retired_by=f"{NARROWED} by {worker}"[:255])
                self.filter(
                    subscriber=s.name,
                    event_type__in=taken,
                    retired_by__startswith=NARROWED,
                ).update(retired_at=None, retired_by="")

    def _ensure_cursors(self, subscribers, now: datetime.datetime) -> None:
        """Stream delivery: a subscriber recorded for the first time gets its
        cursors now, so it receives the events committed from now on,
        whichever relay runs first (:meth:`CursorQuerySet.ensure`). One that
        was recorded before (by a relay of a version without cursors, or
        before stream delivery was turned on) starts at the earliest event
        kept: none written since is missed."""
        from .gateway import streaming

        if streaming(self.db):
            cursor = self.model._meta.apps.get_model(
                self.model._meta.app_label, "Cursor"
            )
            cursor.objects.using(self.db).ensure(subscribers, now=now)

    def _seen(self, rows, key: list[str], worker, now, heartbeat) -> None:
        """Insert the missing ``rows`` (a retired row stays retired); refresh
        ``last_seen_at`` of those older than :data:`HEARTBEAT_SECONDS` (with
        ``heartbeat``). ``key``: the fields of the unique constraint."""
        if not rows:
            return
        self.bulk_create(rows, ignore_conflicts=True)
        if heartbeat:
            stale = now - datetime.timedelta(seconds=HEARTBEAT_SECONDS)
            mine = Q()
            for row in rows:
                mine |= Q(**{name: getattr(row, name) for name in key})
            self.filter(mine, last_seen_at__lt=stale).update(
                last_seen_at=now, last_seen_by=worker[:255]
            )

    def retire(self, by: str, now: datetime.datetime | None = None) -> int:
        """Retire these rows: fan-out creates no new delivery for them.
        Returns rows retired."""
        return self.active().update(
            retired_at=now or database_now(self.db), retired_by=by
        )

    def reactivate(self) -> int:
        """Undo :meth:`retire`. Returns rows reactivated."""
        return self.filter(retired_at__isnull=False).update(
            retired_at=None, retired_by=""
        )

    # An operator's pause is the subscriber's, whatever the event type: it is
    # written on all of its rows and read as "some row is paused" (a row a
    # relay of a newer version inserts later is paused too). Relays'
    # subscriptions only (not ConsumerSubscription).

    def paused_names(self) -> set[str]:
        """The subscribers an operator paused: a relay claims none of their
        deliveries (one query)."""
        return set(
            self.filter(paused_at__isnull=False)
            .order_by()
            .values_list("subscriber", flat=True)
            .distinct()
        )

    def pause(self, by: str, now: datetime.datetime | None = None) -> int:
        """Pause the subscribers of these rows (every row of each). Returns
        how many subscribers were paused (those paused already are left as
        they were)."""
        names = set(self.values_list("subscriber", flat=True))
        rows = self.model._default_manager.using(self.db).filter(subscriber__in=names)
        names -= rows.paused_names()
        if names:
            rows.filter(subscriber__in=names).update(
                paused_at=now or database_now(self.db), paused_by=by[:255]
            )
        return len(names)

    def resume(self) -> int:
        """Undo :meth:`pause` for the subscribers of these rows. Returns how
        many subscribers were resumed."""
        names = set(self.values_list("subscriber", flat=True))
        rows = self.model._default_manager.using(self.db).filter(subscriber__in=names)
        resumed = rows.paused_names()
        rows.filter(paused_at__isnull=False).update(paused_at=None, paused_by="")
        return len(resumed)


class CursorQuerySet(QuerySet):
    def ensure(
        self,
        subscribers: Iterable,
        *,
        earliest: bool | None = None,
        now: datetime.datetime | None = None,
    ) -> int:
        """Create the cursors of ``subscribers`` (:class:`~outbox_app.
        subscribers.Subscriber` values) that have none yet: one per
        partition (:func:`~outbox_app.store.gateway.partitions`). A new
        cursor starts at the current tick (the events committed from now on),
        or at the earliest event kept where the subscriber's ``start`` is
        ``"earliest"`` or it was recorded before ``now`` (default: the
        database's clock) without cursors (by a relay of a version without
        stream delivery, or while ``OUTBOX_ENGINE`` was ``"rows"``: none of
        its events written since is missed); ``earliest`` overrides both.
        A subscriber renamed
        (its ``aliases``) takes over its former name's cursors instead, so
        it goes on where that one stopped. A subscriber with cursors keeps
        them, whatever their count. One whose cursors another open
        transaction is creating (a publishing one, :mod:`outbox_app.apps`)
        is left to it, without waiting for it to end: the events committed
        meanwhile come after that transaction's first reading, so its
        cursors receive them (should it roll back, the next call creates
        them, starting then).

        Returns:
            Cursors created or taken over.
        """
        from .gateway import Stream, partitions

        created = 0
        for subscriber in subscribers:
            count = partitions(subscriber, self.db)
            mine = self.filter(subscriber=subscriber.name)
            if mine.exists():
                # Whatever their count: a relay whose partitions differ
                # changes them between ticks (relay/stream.py, Cursors).
                continue
            former = self.filter(subscriber__in=subscriber.aliases)
            if former.exists():
                created += former.update(subscriber=subscriber.name)
                continue
            first = earliest
            if first is None:
                first = getattr(
                    subscriber, "start", "now"
                ) == "earliest" or self._recorded_before(subscriber.name, now)
            tick, position = Stream(self.db).first_reading(first)
            now = database_now(self.db)
            rows = [
                self.model(
                    subscriber=subscriber.name,
                    partition=partition,
                    partitions=count,
                    tick=tick,
                    position=position or None,
                    first_tick=tick,
                    first_position=position,
                    created_at=now,
                    updated_at=now,
                )
                for partition in range(count)
            ]
            before = mine.count()
            if (
                unless_waiting(
                    self.db,
                    lambda rows=rows: self.bulk_create(rows, ignore_conflicts=True),
                )
                is None
            ):
                continue  # another open transaction is creating them
            created += mine.count() - before
        return created

    def _recorded_before(self, name: str, now: datetime.datetime | None) -> bool:
        subscription = self.model._meta.apps.get_model(
            self.model._meta.app_label, "Subscription"
        )
        return (
            subscription.objects.using(self.db)
            .filter(subscriber=name, first_seen_at__lt=now or database_now(self.db))
            .exists()
        )


class ConsumerSubscriptionQuerySet(SubscriptionQuerySet):
    process = "consume process"
    name_field = "consumer"
    waiting_model = "InboxMessage"
    waiting_transition = "dead_letter"

    def record(
        self,
        consumers: Iterable,
        worker: str,
        now: datetime.datetime | None = None,
        heartbeat: bool = True,
    ) -> None:
        """Record that a ``consume`` process has ``consumers``
        (:class:`~outbox_app.inbox.Consumer` values): one row per consumer,
        queue and event type (``*``: every type), inserted if missing (a
        retired row stays retired), ``last_seen_at`` refreshed when older than
        :data:`HEARTBEAT_SECONDS` (with ``heartbeat``)."""
        from ..subscribers import WILDCARD

        now = now or database_now(self.db)
        rows = [
            self.model(
                consumer=c.name,
                queue=storable(c.queue)[:255],
                event_type=t,
                ordered=c.ordered,
                first_seen_at=now,
                last_seen_at=now,
                last_seen_by=worker[:255],
            )
            for c in consumers
            for t in sorted(c.event_types or (WILDCARD,))
        ]
        reissued_on_deadlock(
            self.db,
            lambda: self._seen(
                rows, ["consumer", "queue", "event_type"], worker, now, heartbeat
            ),
            "recording consumers",
        )


def _scheduled(now: datetime.datetime) -> Q:
    return Q(state=State.PENDING, deliver_at__gt=now)


def _due(now: datetime.datetime) -> Case:
    """Due now, or at the event's ``deliver_at`` while it is ahead: an
    operator's requeue or replay never delivers a scheduled event early."""
    return Case(
        When(deliver_at__gt=now, then=F("deliver_at")),
        default=Value(now),
        output_field=models.DateTimeField(),
    )


class InboxMessageQuerySet(QuerySet):
    def dead_letter(self, batch_size: int = 1000) -> int:
        """What waits for a consumer retired with ``waiting="skip"`` (the
        inbox lifecycle's ``dead_letter``): its FAILED messages (kept for it
        included) -> DEAD, the error kept, requeueable, in batches. Returns
        rows dead-lettered."""
        return in_batches(
            self.filter(state__in=transition("dead_letter", INBOX).sources),
            batch_size,
            state=InboxState.DEAD,
            next_retry_at=None,
            updated_at=database_now(self.db),
        )

    def requeue(self) -> int:
        """FAILED/DEAD -> FAILED, due now, attempts reset to 0: ``manage.py
        consume`` runs them again (the last error kept as history). Returns
        rows requeued."""
        now = database_now(self.db)
        return self.filter(state__in=INBOX_REQUEUEABLE).update(
            state=InboxState.FAILED, attempts=0, next_retry_at=now, updated_at=now
        )
