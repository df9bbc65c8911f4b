"""Fan-out: undelivered outbox events -> one notification per subscriber.

Only events of types that have a subscriber are taken, so an event nobody
subscribes to stays undelivered and a subscriber deployed later still receives
it (Ekbatan's EventFanoutJob, seed 000). Sentinel rows are never fanned out.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from django.db import transaction
from django.utils import timezone

from .conf import outbox_settings
from .db import lock_waiting
from .models import Notification, OutboxEvent
from .registry import Subscriber
from .registry import subscribers as all_subscribers


def fan_out(
    *,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    subscribers: Sequence[Subscriber] | None = None,
) -> int:
    """Create the notifications of undelivered events, oldest first, in batches.

    Each batch is one short transaction: find the oldest undelivered events of
    subscribed types after the previous batch's last id, lock them by primary
    key, insert their notifications with one ``INSERT ... SELECT`` per
    subscriber (idempotently: the ``(event, subscriber)`` pair is unique), flip
    ``delivered``. Concurrent fan-outs wait for each other's batch rather than
    skip it, so an aggregate's notifications always appear in event order,
    which ordered delivery relies on. An event that commits after this call
    passed its id is left to the next call.

    Args:
        using: database alias.
        batch_size: events per transaction; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop starting new batches after this many seconds;
            ``None`` runs until nothing is left.
        subscribers: whom to fan out to; default every registered handler and
            configured publisher.

    Returns:
        Number of events fanned out.
    """
    subscribers = list(all_subscribers() if subscribers is None else subscribers)
    if not subscribers:
        return 0
    batch_size = batch_size or outbox_settings.BATCH_SIZE
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    pending = OutboxEvent.objects.using(using).undelivered()
    if all(s.event_types is not None for s in subscribers):
        pending = pending.filter(
            event_type__in=set().union(*(s.event_types for s in subscribers))
        )
    pending = pending.order_by("id").values_list("id", flat=True)
    events = OutboxEvent.objects.using(using)
    notifications = Notification.objects.using(using)
    total = 0
    after = None  # the last id fanned out by this call
    while True:
        with transaction.atomic(using=using):
            # Keyset pagination: each batch starts after the previous one, so no
            # plan rereads the events this call has just flipped (with statistics
            # stale after a bulk publish, PostgreSQL walked the primary key from
            # the oldest event every batch; bench/RESULTS.md, benchmark 5). An
            # event that commits late with a lower id is taken by the next call.
            found = pending if after is None else pending.filter(id__gt=after)
            # Then lock the batch by primary key, in id order, whichever index
            # found it: every fan-out takes its locks the same way (MariaDB
            # deadlocked when one scan locked through the primary key and
            # another through the undelivered index), and waits for another
            # one's batch rather than skip it.
            ids = list(
                lock_waiting(
                    pending.filter(id__in=list(found[:batch_size]))
                ).values_list("id", flat=True)
            )
            if not ids:
                return total
            after = ids[-1]
            now = timezone.now()
            batch = events.filter(id__in=ids)
            for subscriber in subscribers:
                notifications.create_for(
                    batch
                    if subscriber.event_types is None
                    else batch.filter(event_type__in=subscriber.event_types),
                    subscriber.name,
                    now,
                )
            batch.update(delivered=True)
        total += len(ids)
        if len(ids) < batch_size or (deadline and time.monotonic() > deadline):
            return total
