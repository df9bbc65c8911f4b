"""Operators' operations on a subscriber: the deliveries ``outbox_requeue``
selects by subscriber name, replaying events to one subscriber, pausing and
resuming a subscriber, retiring and reactivating subscriptions. The
transitions of single rows (requeue, retry now, dead-letter, skip) are
``DeliveryQuerySet.apply`` (``store/querysets.py``).

Every function takes querysets and works in bounded batches, so it behaves the
same on ten rows and on a million, and never loads the rows themselves.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass

from django.db import transaction
from django.db.models import QuerySet

from ..exceptions import renamed
from ..relay import registry
from ..store.clock import database_now
from ..store.lifecycle import REQUEUEABLE, State
from ..store.models import Delivery, OutboxEvent, Subscription
from ..store.querysets import RETIRE_WAITING, keyset_pages
from ..subscribers import WILDCARD
from . import streams

#: Rows one operation handles per statement.
DEFAULT_BATCH_SIZE = 1000


def deliveries_matching(
    *,
    subscriber: str,
    states: Iterable[str] = REQUEUEABLE,
    error_type: str | None = None,
    since: datetime.datetime | None = None,
    using: str = "default",
) -> QuerySet:
    """The deliveries ``manage.py outbox_requeue`` selects.

    Args:
        subscriber: a handler's or publisher's name (or a former name, an alias):
            rows stored under any of its names match.
        states: states to match; FAILED and DEAD by default.
        error_type: only rows whose ``last_error_type`` is exactly this dotted
            path (``"builtins.ConnectionError"``).
        since: only rows whose last failure (or last change) is at or after this
            time (``updated_at``).
        using: database alias.

    Raises:
        UnknownSubscriber: no registered handler or configured publisher has that
            name.
    """
    names = registry.get(subscriber).stored_names
    rows = Delivery.objects.using(using).for_subscribers(names)
    rows = rows.filter(state__in=list(states))
    if error_type:
        rows = rows.filter(last_error_type=error_type)
    if since is not None:
        rows = rows.filter(updated_at__gte=since)
    return rows


@dataclass(frozen=True)
class ReplayResult:
    """What :func:`replay_to` did.

    Attributes:
        created: deliveries created (the subscriber had none for the event).
        reset: existing deliveries put back to PENDING.
        skipped: events left alone: sentinels, types the subscriber does not
            receive, and deliveries a worker is running right now.
    """

    created: int = 0
    reset: int = 0
    skipped: int = 0

    @property
    def queued(self) -> int:
        """Deliveries now due: created plus reset."""
        return self.created + self.reset


def replay_to(
    events: QuerySet,
    subscriber_name: str,
    *,
    batch_size: int = 500,
) -> ReplayResult:
    """Deliver ``events`` (again) to one subscriber: create its delivery, or
    reset the existing one (whatever its state but RUNNING) to PENDING, due now,
    attempts reset. The last error is kept as history.

    This is how a handler deployed after events were published is backfilled, and
    how one subscriber gets events again (a consumer that lost its data).

    Args:
        events: an OutboxEvent queryset; sentinels and events of types the
            subscriber does not receive are skipped.
        subscriber_name: a handler's or publisher's name, or one of its aliases.
        batch_size: events per transaction.

    Returns:
        A :class:`ReplayResult`.

    Raises:
        UnknownSubscriber: no handler or publisher has that name.
    """
    subscriber = registry.get(subscriber_name)
    names = subscriber.stored_names
    alias = events.db
    rows = Delivery.objects.using(alias)
    created = reset = skipped = 0
    for batch in keyset_pages(events.only("id", "event_type"), batch_size):
        wanted = {
            event.id
            for event in batch
            if event.event_type is not None and subscriber.receives(event.event_type)
        }
        skipped += len(batch) - len(wanted)
        if not wanted:
            continue
        with transaction.atomic(using=alias):
            now = database_now(alias)
            existing = rows.filter(event_id__in=wanted, subscriber__in=names)
            existing_ids = set(existing.values_list("event_id", flat=True))
            done = existing.replay(now)
            reset += done
            skipped += len(existing_ids) - done
            created += rows.create_for(
                OutboxEvent.objects.filter(id__in=wanted - existing_ids),
                subscriber.name,
                now,
            )
    return ReplayResult(created, reset, skipped)


def retire(
    subscriptions: QuerySet,
    *,
    waiting: str,
    by: str,
    force: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
) -> tuple[int, int]:
    """Retire subscriptions (:class:`~outbox_app.store.models.Subscription` rows):
    fan-out creates no delivery for them from now on, and stream delivery
    reads their types no more (what the subscriber's cursors have not read
    of them becomes rows: PENDING with ``"keep"``, SKIPPED with ``"skip"``).
    The rule is the one every retire follows
    (:meth:`~outbox_app.store.querysets.SubscriptionQuerySet.retire_and_settle`).

    Args:
        subscriptions: a Subscription queryset; retired rows in it are left
            alone.
        waiting: ``"skip"``: the subscriber's PENDING, FAILED and DEAD
            deliveries of those event types become SKIPPED (finished; RUNNING
            rows are left to the relay that leased them); ``"keep"``: they stay
            as they are, delivered if a relay that has the subscriber runs.
        by: who retired them, stored as ``retired_by`` (``"admin: alice"``).
        force: retire even rows a running relay still has.
        batch_size: deliveries per UPDATE.

    Returns:
        ``(subscriptions retired, deliveries skipped)``.

    Raises:
        SubscriptionInUse: a relay refreshed one of them within
            ``SERVED_SECONDS`` and ``force`` is not set; nothing is changed.
        ValueError: ``waiting`` is not one of :data:`RETIRE_WAITING`.
    """
    alias = subscriptions.db

    def hand_over(pairs: list[tuple[str, str]]) -> int:
        handed = State.PENDING if waiting == "keep" else State.SKIPPED
        skipped = 0
        for name, types in _types_by_subscriber(pairs).items():
            done = streams.hand_over(name, types, handed, alias)
            skipped += done if waiting == "skip" else 0
        return skipped

    return subscriptions.retire_and_settle(
        waiting=waiting, by=by, force=force, batch_size=batch_size, hand_over=hand_over
    )


def _types_by_subscriber(pairs) -> dict[str, set[str] | None]:
    """``(subscriber, event type)`` pairs as each subscriber's types (None:
    every type)."""
    found: dict[str, set[str] | None] = {}
    for name, event_type in pairs:
        if event_type == WILDCARD:
            found[name] = None
        elif found.setdefault(name, set()) is not None:
            found[name].add(event_type)
    return found


def reactivate(subscriptions: QuerySet) -> int:
    """Undo :func:`retire`: fan-out creates deliveries for them again, and
    stream delivery reads their types again (not for events published
    meanwhile: the cursor of a subscriber that had no active subscription
    left starts again at the current tick). Returns rows reactivated."""
    alias = subscriptions.db
    with transaction.atomic(using=alias):
        names = set(
            subscriptions.filter(retired_at__isnull=False).values_list(
                "subscriber", flat=True
            )
        )
        dormant = names - set(
            Subscription.objects.using(alias)
            .active()
            .filter(subscriber__in=names)
            .values_list("subscriber", flat=True)
        )
        reactivated = subscriptions.reactivate()
        streams.restart(sorted(dormant), alias)
    return reactivated


def pause(subscriptions: QuerySet, *, by: str) -> int:
    """Pause the subscribers of ``subscriptions`` (a Subscription queryset):
    every relay stops claiming their deliveries at its next turn (within
    about a second while it drains a backlog), without a restart. Fan-out
    still creates their deliveries, which wait, PENDING or FAILED, with no
    attempt counted; a batch a relay holds already is finished.

    Args:
        subscriptions: a pause applies to the whole subscriber: every event
            type it subscribes to.
        by: who paused them, stored as ``paused_by`` (``"admin: alice"``).

    Returns:
        Subscribers paused (those paused already are left as they were).
    """
    return subscriptions.pause(by)


def resume(subscriptions: QuerySet) -> int:
    """Undo :func:`pause`: relays claim the subscribers' deliveries again at
    their next turn. Returns subscribers resumed."""
    return subscriptions.resume()


def subscriber_choices() -> list[tuple[str, str]]:
    """``(name, label)`` of every handler and publisher, for a form's choices."""
    return [
        (s.name, f"{s.name} ({s.kind}{', ordered' if s.ordered else ''})")
        for s in sorted(registry.subscribers(), key=lambda s: s.name)
    ]


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "RETIRE_WAITING",
    "ReplayResult",
    "deliveries_matching",
    "pause",
    "reactivate",
    "replay_to",
    "resume",
    "retire",
    "subscriber_choices",
]

__getattr__ = renamed(__name__, {"WAITING": "RETIRE_WAITING"})
