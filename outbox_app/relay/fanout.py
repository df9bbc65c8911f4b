"""Fan-out: outbox events awaiting fan-out -> one delivery per subscription.

Fan-out creates deliveries for every active :class:`~outbox_app.store.models.
Subscription` of an event's type, not only for the subscribers this process
has: each relay records the subscribers it has (:func:`subscribed_types`), so
during a rolling deploy a relay of the old version fans out to a subscriber
only the new version has, and the deliveries wait for a relay that has it.
Only events of types that have a subscription are taken, so an event nobody
subscribes to waits for fan-out and a subscriber deployed later still receives
it. Sentinel rows are never fanned out.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..conf import outbox_settings
from ..events.ids import worker_name
from ..store.clock import database_now
from ..store.gateway import Gateway
from ..store.models import Subscription
from ..store.querysets import HEARTBEAT_SECONDS
from ..subscribers import WILDCARD, Subscriber
from . import registry

logger = logging.getLogger("outbox_app.relay")

_lock = threading.Lock()
#: (alias, subscriptions this process has) -> when it last recorded them
#: (time.monotonic()).
_recorded: dict[tuple[str, frozenset], float] = {}
#: (alias, subscriber, event type) this process has and found retired (logged).
_warned: set[tuple[str, str, str]] = set()


def _read(rows) -> dict[tuple[str, str], bool]:
    """Every stored subscription: (subscriber, event type) -> retired."""
    return {
        (subscriber, event_type): retired_at is not None
        for subscriber, event_type, retired_at in rows.values_list(
            "subscriber", "event_type", "retired_at"
        )
    }


def subscribed_types(
    subscribers: Sequence[Subscriber], using: str = "default"
) -> frozenset[str] | None:
    """Record ``subscribers`` as this process's, then return the event types
    some active subscription receives.

    Recording (``Subscription.objects.record``) inserts the rows that are
    missing, refreshes ``last_seen_at`` every ``HEARTBEAT_SECONDS`` and
    retires the rows of former names (``aliases``); it runs on the first call
    of a process, once a heartbeat is due, and whenever a subscription this
    process has is missing from the table. A subscription an operator retired
    stays retired (logged once per process): retiring is an explicit act,
    and so is reactivating (``manage.py outbox_subscribers --reactivate``).

    Returns:
        The event types (an empty set: nothing is subscribed), or ``None``
        when some subscription receives every type.
    """
    local = {
        (s.name, t) for s in subscribers for t in sorted(s.event_types or (WILDCARD,))
    }
    rows = Subscription.objects.using(using)
    stored = _read(rows)
    key = (using, frozenset(local))
    with _lock:
        last = _recorded.get(key)
        due = last is None or time.monotonic() - last >= HEARTBEAT_SECONDS
        if due or local - stored.keys():
            _recorded[key] = time.monotonic()
            due = True
    if due:
        rows.record(subscribers, worker_name(), started=last is None)
        stored = _read(rows)
    active = {pair for pair, retired in stored.items() if not retired}
    for pair in sorted(local - active):
        if (using, *pair) not in _warned:
            _warned.add((using, *pair))
            logger.warning(
                "subscription %s <- %s is retired: this relay delivers the "
                "deliveries it has, fan-out creates no new ones "
                "(manage.py outbox_subscribers --reactivate %s)",
                *pair,
                pair[0],
            )
    types = {event_type for _, event_type in active}
    return None if WILDCARD in types else frozenset(types)


def recorded_types(
    using: str = "default",
) -> dict[str, frozenset[str] | None]:
    """The event types each recorded subscriber's active subscriptions
    receive, whichever relay recorded them (None: every type; an empty set:
    every subscription of it is retired): what stream delivery reads for
    it, so an event of a type only another version of the subscriber
    receives is kept for that version, as fan-out keeps it."""
    found: dict[str, set[str]] = {}
    for name, event_type, retired_at in Subscription.objects.using(using).values_list(
        "subscriber", "event_type", "retired_at"
    ):
        types = found.setdefault(name, set())
        if retired_at is None:
            types.add(event_type)
    return {
        name: None if WILDCARD in types else frozenset(types)
        for name, types in found.items()
    }


def fan_out(
    *,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    subscribers: Sequence[Subscriber] | None = None,
    types_of: Callable[[Sequence[Subscriber]], frozenset[str] | None] | None = None,
) -> int:
    """Create the deliveries of events awaiting fan-out, oldest first, in batches.

    Each batch is one short transaction (one statement on PostgreSQL): lock
    the oldest events awaiting fan-out of subscribed types after the previous
    batch's last id, skipping those another relay is fanning out, insert one
    PENDING delivery per subscriber of their type (idempotently: the
    ``(event, subscriber)`` pair is unique), flip ``fanned_out`` of those that
    have a delivery (an event whose only subscription was retired
    meanwhile waits for fan-out)
    (:meth:`Gateway.fan_out <outbox_app.store.gateway.Gateway.fan_out>`).
    Keyset pagination keeps each batch's scan to the rows it takes, however
    stale the table's statistics (docs/performance.md, "Scale"); an event
    that commits after this call passed its id is left to the next call.

    Args:
        using: database alias.
        batch_size: events per transaction; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop starting new batches after this many seconds
            (``0``: one batch); ``None`` runs until nothing is left.
        subscribers: recorded as this process's subscribers first (see
            :func:`subscribed_types`); default every registered handler and
            configured publisher. Deliveries are created for every active
            subscription, whoever recorded it.
        types_of: reads the event types ``subscribers`` make fan out
            (default :func:`subscribed_types` on ``using``; a relay's loop
            passes the reading it keeps, refreshed once a second).

    Returns:
        Number of events fanned out.
    """
    chosen = registry.subscribers() if subscribers is None else subscribers
    types = (types_of or functools.partial(subscribed_types, using=using))(chosen)
    if types is not None and not types:
        return 0
    batch_size = batch_size or outbox_settings.BATCH_SIZE
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    gateway = Gateway(using)
    total = 0
    after = None  # the last id fanned out by this call
    while True:
        step = gateway.fan_out(types, batch_size, after, database_now(using))
        total += step.fanned_out
        if len(step.scanned) < batch_size or (
            deadline is not None and time.monotonic() >= deadline
        ):
            return total
        after = step.scanned[-1]
