"""What the relay delivers to: subscribers and the context of one delivery.

A subscriber is an in-process :class:`Handler` (registered with
:func:`outbox_app.relay.registry.handler`) or a broker publisher
(:class:`outbox_app.publishers.base.Publisher`, configured in
``OUTBOX_PUBLISHERS``). Both share the delivery options of
:class:`Subscriber`; a handler and a ``consume`` process's consumer share
those of :class:`Callee`, and all three those of :class:`Receiver`. The
relay hands each delivery's :class:`DeliveryContext` to a handler beside the
event, and to a publisher as the message to send.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from django.core.exceptions import ImproperlyConfigured

from .conf import outbox_settings

#: Guards the registries of handlers and consumers (their tables are read
#: from several threads: Celery's pools, the relay's sidecar).
registry_lock = threading.Lock()

Kind = Literal["handler", "publisher"]
#: In ``EVENT_TYPES``: every event type.
WILDCARD = "*"


@dataclass(frozen=True)
class DeliveryContext:
    """What a handler receives besides the event, and what a publisher sends.

    Attributes:
        event_id: the outbox event's id (UUIDv7); consumers deduplicate by it.
        namespace: the publishing service (``OUTBOX_NAMESPACE``).
        event_type, revision: the stored type name and payload revision.
        payload: the stored JSON payload (plain JSON types).
        aggregate_type, aggregate_id, aggregate_version: the aggregate, if any.
        headers: the envelope headers given to ``publish()``.
        tenant_id, action_id: tenant and action, if any.
        occurred_at: when the event was published (aware datetime), by the
            database's clock (``publish()`` stamps it, as its ``created_at``).
        attempt: this delivery attempt, 1 for the first.
        subscriber: the receiving subscriber's name.
        delivery_id: the delivery row being delivered; None when stream
            delivery delivers the event from a subscriber's cursor (no row
            exists unless the attempt fails).
        deliver_at: when the event was scheduled for (``publish(deliver_at=
            ...)``); None: at once.
        operation: what happened to the aggregate (``publish(operation=...)``;
            ``create``, ``update``, ``delete``, ``soft_delete`` for a tracked
            model), or None.
        expires_at: when the event expires (``publish(expires_at=...)``):
            a delivery not made by then is skipped. None: never.
        payload_bytes: the length of the payload's JSON text as published,
            in bytes (what a batch's ``OUTBOX_BATCH_BYTES`` counts).
        position: the event's publish order (numbered by the database on
            insert), or None where the delivery's read does not carry it.
        using: the alias of the database whose outbox holds the event (the
            relay's ``--database``); a handler's writes on it commit with the
            delivery's mark. An event published on several databases
            (``publish(using=[...])``) is delivered once from each, with one
            ``event_id`` and each its own ``using``.
    """

    event_id: uuid.UUID
    namespace: str
    event_type: str
    revision: int
    payload: dict[str, Any]
    aggregate_type: str | None
    aggregate_id: str | None
    aggregate_version: int | None
    headers: dict[str, Any]
    tenant_id: str | None
    action_id: uuid.UUID | None
    occurred_at: datetime.datetime
    attempt: int
    subscriber: str
    delivery_id: int | None
    deliver_at: datetime.datetime | None = None
    expires_at: datetime.datetime | None = None
    operation: str | None = None
    payload_bytes: int = 0
    using: str = "default"
    position: int | None = None


@dataclass(eq=False)
class Receiver:
    """Anything that receives events: a relay's subscriber (a :class:`Handler`,
    a :class:`~outbox_app.publishers.base.Publisher`) or a ``consume``
    process's consumer (:class:`~outbox_app.inbox.Consumer`). Its attributes
    say which events it receives, in which order, and how its failures are
    retried: :meth:`RetryPolicy.of <outbox_app.execution.retry.RetryPolicy.of>`
    makes its policy from them, the one path for all three kinds.

    They are the options of ``@handler`` and ``@consumer`` of the same names,
    and of an ``OUTBOX_PUBLISHERS`` entry (``EVENT_TYPES``, ``ORDERED``,
    ``MAX_ATTEMPTS``; a publisher's errors are its backend's: retried, but
    :class:`~outbox_app.exceptions.UndeliverableMessage` is dead at once).
    """

    #: The stable key its rows are stored under (deliveries, inbox
    #: messages): a handler's or a consumer's default is its function's
    #: dotted path (``module.qualname``), a publisher's its
    #: ``OUTBOX_PUBLISHERS`` key. Renamed, every event is new to it (a
    #: subscriber's :attr:`~Subscriber.aliases` keep its old rows flowing).
    name: str
    #: The event types it receives; None: every type (``"*"``).
    event_types: frozenset[str] | None
    #: Receive each aggregate's events strictly in publish order: a later
    #: one waits while an earlier one of its aggregate is unfinished
    #: (failing, or DEAD until an operator requeues or skips it).
    ordered: bool = False
    #: Attempts before the dead letter (DEAD); None: ``OUTBOX_MAX_ATTEMPTS``.
    max_attempts: int | None = None
    #: Exception classes retried after a backoff (from
    #: ``OUTBOX_RETRY_BASE_SECONDS`` doubling up to
    #: ``OUTBOX_RETRY_MAX_SECONDS``, full jitter); any other is dead at once.
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    #: Exception classes dead at once, checked before ``retry_on``.
    give_up_on: tuple[type[BaseException], ...] = ()

    def receives(self, event_type: str) -> bool:
        """Whether it receives events of ``event_type``."""
        return self.event_types is None or event_type in self.event_types

    @property
    def attempts_allowed(self) -> int:
        """``max_attempts``, or ``OUTBOX_MAX_ATTEMPTS`` when None."""
        return self.max_attempts or outbox_settings.MAX_ATTEMPTS


@dataclass(eq=False)
class Callee(Receiver):
    """User code that receives events, called by the relay or by ``consume``
    through the one wrapper of user code
    (:class:`~outbox_app.execution.run.Execution`): a :class:`Handler` or a
    :class:`~outbox_app.inbox.Consumer`. Beside :class:`Receiver`'s
    options, the function and its time limit.
    """

    #: ``fn(event, context)``: called with the rebuilt event (an ``Event``
    #: instance, or the payload dict for a type no class defines) and the
    #: context (a :class:`DeliveryContext` for a handler, a
    #: :class:`~outbox_app.inbox.ConsumeContext` for a consumer). What it
    #: returns is ignored; what it raises fails the attempt.
    fn: Callable[[Any, Any], Any] = field(default=lambda e, c: None)
    #: Seconds one call may run before
    #: :class:`~outbox_app.exceptions.CallTimeout` interrupts it (a failed
    #: attempt; SIGALRM, so in the process's main thread only; an alarm
    #: inside a database call waits for the call to return); None: no limit.
    timeout: float | None = None


@dataclass(eq=False)
class Subscriber(Receiver):
    """What the relay delivers to: a :class:`Handler` or a
    :class:`~outbox_app.publishers.base.Publisher`. Beside
    :class:`Receiver`'s options, how its rows and its stream are kept.
    """

    kind: ClassVar[Kind]

    #: Former names whose stored rows this subscriber still takes.
    aliases: tuple[str, ...] = ()
    #: Stream delivery: where its cursor starts when it is first recorded,
    #: ``"now"`` or ``"earliest"`` (every event kept).
    start: str = "now"
    #: Stream delivery: how many partitions its events are split into;
    #: None: ``OUTBOX_PARTITIONS``.
    partitions: int | None = None

    @property
    def stored_names(self) -> tuple[str, ...]:
        """Names its delivery rows may carry: its own and its aliases."""
        return (self.name, *self.aliases)


@dataclass(eq=False)
class Handler(Callee, Subscriber):
    """An in-process handler, registered with ``@handler``
    (:func:`outbox_app.relay.registry.handler`): ``fn(event, context)`` with
    a :class:`DeliveryContext`. Its options are :class:`Callee`'s and
    :class:`Subscriber`'s."""

    kind: ClassVar[Kind] = "handler"


#: Where a new subscriber's cursor may start.
STARTS = ("now", "earliest")


def check_stream_options(owner: str, start: Any, partitions: Any) -> None:
    """Raise ImproperlyConfigured, naming ``owner``, for a ``start`` not in
    :data:`STARTS` or ``partitions`` that is not None or a positive
    integer."""
    if start not in STARTS:
        raise ImproperlyConfigured(
            f"{owner}: start must be one of {', '.join(map(repr, STARTS))}, "
            f"got {start!r}"
        )
    if partitions is not None and (
        not isinstance(partitions, int)
        or isinstance(partitions, bool)
        or partitions < 1
    ):
        raise ImproperlyConfigured(
            f"{owner}: partitions must be a positive integer or None, "
            f"got {partitions!r}"
        )


def dotted_path(fn: Callable) -> str:
    """A function's or a class's ``module.qualname``: the default name of a
    handler or a consumer, the error type failed rows record."""
    return f"{fn.__module__}.{fn.__qualname__}"


def keep(table: dict[str, Any], spec: Any, kind: str) -> None:
    """Put ``spec`` (a handler's or a consumer's: ``name`` and ``fn``) in
    ``table`` under its name; registering the same function again replaces it.

    Raises:
        ImproperlyConfigured: the name belongs to another function.
    """
    with registry_lock:
        existing = table.get(spec.name)
        if existing is not None and dotted_path(existing.fn) != dotted_path(spec.fn):
            raise ImproperlyConfigured(
                f"{kind} name {spec.name!r} is used by both "
                f"{dotted_path(existing.fn)} and {dotted_path(spec.fn)}; pass name= "
                "to one of them"
            )
        table[spec.name] = spec
