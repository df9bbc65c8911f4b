"""Fan-out: undelivered outbox events -> one notification per subscriber.

Only events of types that have a subscriber are taken, so an event nobody
subscribes to stays undelivered and a subscriber deployed later still receives
it (Ekbatan's EventFanoutJob, seed 000). Sentinel rows are never fanned out.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from django.utils import timezone

from .. import registry
from ..conf import outbox_settings
from ..subscribers import Subscriber
from .gateway import Gateway, Subscription


def subscriptions_of(subscribers: Iterable[Subscriber]) -> list[Subscription]:
    """What fan-out creates notifications for: each subscriber's name and
    event types."""
    return [Subscription(s.name, s.event_types) for s in subscribers]


def fan_out(
    *,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    subscribers: Sequence[Subscriber] | None = None,
) -> int:
    """Create the notifications of undelivered events, oldest first, in batches.

    Each batch is one short transaction (one statement on PostgreSQL): lock
    the oldest undelivered events of subscribed types after the previous
    batch's last id, skipping those another relay is fanning out, insert one
    PENDING notification per subscriber of their type (idempotently: the
    ``(event, subscriber)`` pair is unique), flip ``delivered``
    (:meth:`Gateway.fan_out <outbox_app.delivery.gateway.Gateway.fan_out>`).
    Keyset pagination keeps each batch's scan to the rows it takes, however
    stale the table's statistics (bench/RESULTS.md, benchmark 5); an event
    that commits after this call passed its id is left to the next call.

    Args:
        using: database alias.
        batch_size: events per transaction; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop starting new batches after this many seconds
            (``0``: one batch); ``None`` runs until nothing is left.
        subscribers: whom to fan out to; default every registered handler and
            configured publisher.

    Returns:
        Number of events fanned out.
    """
    subscriptions = subscriptions_of(
        registry.subscribers() if subscribers is None else subscribers
    )
    if not subscriptions:
        return 0
    batch_size = batch_size or outbox_settings.BATCH_SIZE
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    gateway = Gateway(using)
    total = 0
    after = None  # the last id fanned out by this call
    while True:
        ids, _ = gateway.fan_out(subscriptions, batch_size, after, timezone.now())
        total += len(ids)
        if len(ids) < batch_size or (
            deadline is not None and time.monotonic() >= deadline
        ):
            return total
        after = ids[-1]
