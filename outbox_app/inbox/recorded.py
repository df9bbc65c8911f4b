"""The consumers ``consume`` processes recorded
(:class:`~outbox_app.store.models.ConsumerSubscription`), so that no process
acknowledges as ignored a message another version of the code consumes.

Each ``consume`` process records its consumers (name, queue, event types)
when it starts and refreshes them every ``HEARTBEAT_SECONDS``
(:func:`record`). A message of queue Q and type T that an active recorded
consumer X of Q receives, and that this process has no consumer X of Q
receiving T for, is kept as X's inbox row (FAILED, due now, no attempt
counted, the body kept): a process that has X runs it from the database
(``retry_due``). This is what makes a rolling deploy of a new consumer
safe: the processes of the old code keep its messages instead of dropping
them. Retiring a consumer is explicit (``manage.py outbox_subscribers
--retire``: :meth:`~outbox_app.store.querysets.SubscriptionQuerySet.
retire_and_settle`, the rule every retire follows).
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterable, Sequence

from ..events.ids import worker_name
from ..store.models import ConsumerSubscription
from ..subscribers import WILDCARD
from .registry import Consumer

logger = logging.getLogger("outbox_app.inbox")

_lock = threading.Lock()
#: (alias, consumer, queue, event type) this process has and found retired.
_warned: set[tuple[str, str, str, str]] = set()


def record(consumers: Sequence[Consumer], using: str) -> None:
    """Record ``consumers`` as this process's (``consume`` does at start, then
    every ``HEARTBEAT_SECONDS``); log once per process each of them an
    operator retired (it still runs here, but the processes that lack it no
    longer keep its messages).

    Raises:
        django.db.DatabaseError: the database failed.
    """
    rows = ConsumerSubscription.objects.using(using)
    rows.record(consumers, worker_name())
    retired = rows.filter(
        retired_at__isnull=False, consumer__in=[c.name for c in consumers]
    ).values_list("consumer", "queue", "event_type")
    for name, queue, event_type in retired:
        with _lock:
            if (using, name, queue, event_type) in _warned:
                continue
            _warned.add((using, name, queue, event_type))
        logger.warning(
            "consumer %s <- %s on %s is retired: this process runs its messages, "
            "processes without it no longer keep them for it "
            "(manage.py outbox_subscribers --reactivate %s)",
            name,
            event_type,
            queue,
            name,
        )


class Recorded:
    """The active recorded consumers of some queues, read once (one query).

    Args:
        queues: the queues of the messages at hand.
        using: database alias.
    """

    def __init__(self, queues: Iterable[str], using: str):
        self.by_queue: dict[str, list[tuple[str, str]]] = defaultdict(list)
        found = (
            ConsumerSubscription.objects.using(using)
            .active()
            .filter(queue__in=set(queues))
            .values_list("consumer", "queue", "event_type")
        )
        for name, queue, event_type in found:
            self.by_queue[queue].append((name, event_type))

    def absent(
        self, queue: str, event_type: str, mine: Sequence[Consumer]
    ) -> list[str]:
        """The recorded consumers of ``queue`` that receive ``event_type`` and
        that are not among ``mine`` (this process's consumers of ``queue``
        receiving it), by name."""
        here = {c.name for c in mine}
        return sorted(
            {
                name
                for name, recorded in self.by_queue.get(queue, ())
                if recorded in (event_type, WILDCARD) and name not in here
            }
        )
