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
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ..events.types import Event, validate_event_type
from ..exceptions import OutboxDeprecationWarning
from ..execution.retry import RetryPolicy
from ..subscribers import WILDCARD, Callee, dotted_path, keep, registry_lock

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


@dataclass(eq=False, kw_only=True)
class Consumer(Callee):
    """One ``@consumer``: ``fn(event, context)`` for the messages of its types
    arriving on its queue, with a :class:`ConsumeContext`. Its other options
    are :class:`~outbox_app.subscribers.Callee`'s, a handler's too (``name``:
    the stable key of its inbox rows; ``ordered``: each aggregate's messages
    in arrival order, a message waiting while an earlier one of its
    aggregate is failing or DEAD).
    """

    #: The queue it reads (declared durable, bound to
    #: ``OUTBOX_INBOX_EXCHANGE`` with ``bindings``).
    queue: str
    #: Routing keys the queue is bound with (topic patterns).
    bindings: tuple[str, ...] = ("#",)

    def policy(self) -> RetryPolicy:
        """Its retry policy. Deprecated: ``RetryPolicy.of(consumer)``, the
        one path for handlers, publishers and consumers; this method goes in
        the next release."""
        warnings.warn(
            "Consumer.policy() is replaced by RetryPolicy.of(consumer); it goes "
            "in the next release",
            OutboxDeprecationWarning,
            stacklevel=2,
        )
        return RetryPolicy.of(self)


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
        ordered, max_attempts, retry_on, give_up_on, timeout: as a
            handler's (:class:`~outbox_app.subscribers.Callee`): per-aggregate
            order, attempts before the message is DEAD, exception classes
            retried / dead-lettered at once, seconds one call may run.

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
