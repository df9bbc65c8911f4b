"""Which consumers this process has: ``@consumer`` functions, found in each
installed app's ``consumers.py`` as handlers are in ``handlers.py``, and the
:class:`ConsumeContext` each receives. It loads no model: ``consumer`` and
``ConsumeContext`` import before Django's app registry is ready.

A consumer's ``name`` is the stable key of its inbox rows: a message is handled
once per consumer name, so renaming a consumer makes every message new to it.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ..events.types import Event, validate_event_type
from ..execution.retry import RetryPolicy
from ..subscribers import WILDCARD, dotted_path, keep, registry_lock

_consumers: dict[str, Consumer] = {}


@dataclass(frozen=True)
class ConsumeContext:
    """What a consumer receives besides the event.

    Attributes:
        message_id: the CloudEvents ``id`` (for outbox_app's producers, the
            outbox event id): with ``source``, the inbox's deduplication key.
        event_id: ``message_id`` as a UUID, or None if it is not one (a
            foreign producer's id).
        source: the producing service (CloudEvents ``source``: its
            ``OUTBOX_NAMESPACE``); ids are unique per source.
        event_type, revision: the type and payload revision (1 if absent).
        payload: the CloudEvent's ``data``.
        aggregate_type, aggregate_id, aggregate_version: the aggregate, if any
            (``aggregatetype``, ``subject``, ``aggregateversion``).
        tenant_id, action_id: ``tenantid``, ``actionid`` if any.
        headers: ``correlation_id``, ``causation_id``, ``traceparent``,
            ``tracestate``, ``actor`` and ``metadata`` when the message
            carries them, as the text on the wire (``metadata``: a JSON
            object's text).
        occurred_at, deliver_at, expires_at: ``time``, ``deliverat``,
            ``expiretime`` (aware datetimes) or None.
        operation: the ``operation`` attribute (a tracked model's create,
            update, delete, soft_delete), or None.
        envelope: the whole CloudEvent as received.
        attempt: 1 for the first run, 2 for the first retry, ...
        consumer, queue: who runs it, and where it came from.
    """

    message_id: str
    event_id: uuid.UUID | None
    source: str
    event_type: str
    revision: int
    payload: Any
    aggregate_type: str | None
    aggregate_id: str | None
    aggregate_version: int | None
    tenant_id: str | None
    action_id: str | None
    headers: dict[str, str]
    occurred_at: datetime.datetime | None
    deliver_at: datetime.datetime | None
    expires_at: datetime.datetime | None
    operation: str | None
    envelope: dict[str, Any]
    attempt: int
    consumer: str
    queue: str


@dataclass(frozen=True)
class Consumer:
    """One ``@consumer``: ``fn(event, context)`` for the messages of its types
    arriving on its queue.

    Attributes:
        name: stable key of its inbox rows.
        fn: the callable; it receives the rebuilt event (an ``Event`` instance,
            or the CloudEvent's ``data`` dict for a type no class defines) and a
            :class:`ConsumeContext`.
        event_types: the types it receives; ``None``: every type.
        queue: the queue it reads (declared durable, bound to
            ``OUTBOX_INBOX_EXCHANGE`` with ``bindings``).
        bindings: routing keys the queue is bound with (topic patterns).
        ordered: run each aggregate's messages in arrival order: a message
            waits while an earlier one of its aggregate is failing or dead.
        max_attempts: attempts before a failing message is DEAD; ``None``
            uses ``OUTBOX_MAX_ATTEMPTS``.
        retry_on, give_up_on: as for handlers: exceptions retried with backoff,
            exceptions dead-lettered at once.
        timeout: seconds one call may run before
            :class:`~outbox_app.exceptions.HandlerTimeout` interrupts it (a
            failed attempt; SIGALRM, so in ``consume``'s main thread only; an
            alarm inside a database call waits for the call to return);
            ``None`` for no limit.
    """

    name: str
    fn: Callable[[Any, Any], Any]
    event_types: frozenset[str] | None
    queue: str
    bindings: tuple[str, ...] = ("#",)
    ordered: bool = False
    max_attempts: int | None = None
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    give_up_on: tuple[type[BaseException], ...] = ()
    timeout: float | None = None

    def receives(self, event_type: str) -> bool:
        return self.event_types is None or event_type in self.event_types

    def policy(self) -> RetryPolicy:
        """Its retry policy with the current ``OUTBOX_*`` settings (the relay's
        backoff: :class:`~outbox_app.execution.retry.RetryPolicy`)."""
        return RetryPolicy.with_options(
            self.max_attempts, self.retry_on, self.give_up_on
        )


def consumer(
    *event_types: type[Event] | str,
    queue: str,
    name: str | None = None,
    bindings: Sequence[str] = ("#",),
    ordered: bool = False,
    max_attempts: int | None = None,
    retry_on: Sequence[type[BaseException]] = (Exception,),
    give_up_on: Sequence[type[BaseException]] = (),
    timeout: float | None = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn(event, context)`` as a consumer of the messages of
    ``event_types`` on ``queue``, run by ``manage.py consume`` through the
    transactional inbox (docs/consumers.md).

    Put consumers in a ``consumers.py`` module of an installed app: outbox_app
    imports every app's ``consumers`` module at start-up.

    Args:
        *event_types: Event classes or type names (``"*"``: every type); a
            type no Event class defines (another producer's) reaches ``fn`` as
            the CloudEvent's ``data`` dict.
        queue: the queue to read; several consumers may share one.
        name: stable key of its inbox rows; default the function's dotted path.
        bindings: routing keys binding ``queue`` to ``OUTBOX_INBOX_EXCHANGE``
            (default ``("#",)``: everything on a topic exchange).
        ordered: per-aggregate order (see :class:`Consumer`).
        max_attempts: attempts before the message is DEAD.
        retry_on, give_up_on: exception classes retried / dead-lettered at once.
        timeout: seconds one call may run (see :class:`Consumer`).

    Returns:
        The decorator; it returns ``fn`` unchanged.

    Raises:
        ImproperlyConfigured: no event type, an empty queue name, or a name
            already taken by another function.
        InvalidEventType: a malformed type name.
    """
    if not event_types:
        raise ImproperlyConfigured("@consumer needs at least one event class or type")
    if not isinstance(queue, str) or not queue:
        raise ImproperlyConfigured(f"@consumer needs a queue name, got {queue!r}")
    names = [t if isinstance(t, str) else t.event_type for t in event_types]
    types = (
        None if WILDCARD in names else frozenset(validate_event_type(t) for t in names)
    )

    def register(fn: Callable) -> Callable:
        spec = Consumer(
            name=name or dotted_path(fn),
            fn=fn,
            event_types=types,
            queue=queue,
            bindings=tuple(bindings),
            ordered=ordered,
            max_attempts=max_attempts,
            retry_on=tuple(retry_on),
            give_up_on=tuple(give_up_on),
            timeout=timeout,
        )
        keep(_consumers, spec, "consumer")
        return fn

    return register


def consumers(queues: Sequence[str] | None = None) -> list[Consumer]:
    """Every registered consumer, or those reading one of ``queues``."""
    with registry_lock:
        found = list(_consumers.values())
    return [c for c in found if queues is None or c.queue in queues]


def get_consumer(name: str) -> Consumer | None:
    with registry_lock:
        return _consumers.get(name)


def unregister_consumer(name: str) -> None:
    """Remove a consumer (tests)."""
    with registry_lock:
        _consumers.pop(name, None)
