"""Subscribers: in-process handlers (``@handler``) and broker publishers
(``OUTBOX_PUBLISHERS``), and which event types each receives.

A subscriber's ``name`` is the stable key stored on its notifications. A handler's
defaults to the function's dotted path; ``aliases`` keeps rows stored under an
old name flowing after a rename. A publisher's name is its ``OUTBOX_PUBLISHERS``
key.
"""

from __future__ import annotations

import datetime
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from django.core.exceptions import ImproperlyConfigured

from .conf import outbox_settings
from .events import Event, validate_event_type
from .exceptions import UnknownSubscriber

if TYPE_CHECKING:
    from .publishers.base import Publisher

Kind = Literal["handler", "publisher"]
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
        occurred_at: when the event was published (aware datetime).
        attempt: this delivery attempt, 1 for the first.
        subscriber: the receiving subscriber's name.
        notification_id: the notification row being delivered.
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
    notification_id: int


@dataclass(eq=False)
class Subscriber:
    """Anything that receives events: common delivery options.

    Attributes:
        name: stable key stored on notifications.
        event_types: the types received; ``None`` means every type.
        ordered: deliver each aggregate's events strictly in publish order.
        max_attempts: attempts before EXPIRED; ``None`` uses OUTBOX_MAX_ATTEMPTS.
        aliases: former names whose stored rows this subscriber still takes.
    """

    kind: ClassVar[Kind]

    name: str
    event_types: frozenset[str] | None
    ordered: bool = False
    max_attempts: int | None = None
    aliases: tuple[str, ...] = ()

    @property
    def stored_names(self) -> tuple[str, ...]:
        """Names its notification rows may carry: its own and its aliases."""
        return (self.name, *self.aliases)

    def receives(self, event_type: str) -> bool:
        return self.event_types is None or event_type in self.event_types

    @property
    def attempts_allowed(self) -> int:
        return self.max_attempts or outbox_settings.MAX_ATTEMPTS


@dataclass(eq=False)
class Handler(Subscriber):
    """An in-process handler: ``fn(event, context)``.

    Attributes:
        fn: the callable. It receives the rebuilt event (an ``Event`` instance, or
            the payload dict for a type with no class) and a DeliveryContext.
        retry_on: exceptions that fail the attempt and are retried.
        give_up_on: exceptions that expire the notification at once.
        timeout: seconds an attempt may run before HandlerTimeout interrupts it
            (main thread only, via SIGALRM); ``None`` for no limit.
    """

    fn: Callable[[Any, DeliveryContext], Any] = field(default=lambda e, c: None)
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    give_up_on: tuple[type[BaseException], ...] = ()
    timeout: float | None = None

    kind: ClassVar[Kind] = "handler"


_handlers: dict[str, Handler] = {}
_lock = threading.Lock()


def handler(
    *event_types: type[Event] | str,
    name: str | None = None,
    max_attempts: int | None = None,
    retry_on: Sequence[type[BaseException]] = (Exception,),
    give_up_on: Sequence[type[BaseException]] = (),
    ordered: bool = False,
    timeout: float | None = None,
    aliases: Iterable[str] = (),
) -> Callable[[Callable], Callable]:
    """Register ``fn(event, context)`` as an in-process handler.

    Put handlers in a ``handlers.py`` module of an installed app: outbox_app
    imports every app's ``handlers`` module at start-up, as the admin does with
    ``admin.py``.

    Args:
        *event_types: Event classes or type names the handler receives.
        name: stable key stored on its notifications; defaults to the function's
            dotted path (``module.qualname``).
        max_attempts: attempts before the notification EXPIRES; default
            ``OUTBOX_MAX_ATTEMPTS``.
        retry_on: exception classes that are retried with backoff.
        give_up_on: exception classes that expire the notification at once
            (checked first).
        ordered: deliver each aggregate's events strictly in publish order.
        timeout: seconds one attempt may run; ``None`` for no limit.
        aliases: former names; notifications stored under them keep flowing to
            this handler after a rename.

    Returns:
        The decorator; it returns ``fn`` unchanged.

    Raises:
        ImproperlyConfigured: no event type, or a name already taken by another
            function.
        InvalidEventType: a malformed type name.
    """
    if not event_types:
        raise ImproperlyConfigured("@handler needs at least one event class or type")
    types = frozenset(
        validate_event_type(t if isinstance(t, str) else t.event_type)
        for t in event_types
    )

    def register(fn: Callable) -> Callable:
        key = name or f"{fn.__module__}.{fn.__qualname__}"
        spec = Handler(
            name=key,
            event_types=types,
            ordered=ordered,
            max_attempts=max_attempts,
            aliases=tuple(aliases),
            fn=fn,
            retry_on=tuple(retry_on),
            give_up_on=tuple(give_up_on),
            timeout=timeout,
        )
        with _lock:
            existing = _handlers.get(key)
            if existing is not None and _path(existing.fn) != _path(fn):
                raise ImproperlyConfigured(
                    f"handler name {key!r} is used by both {_path(existing.fn)} and "
                    f"{_path(fn)}; pass name= to one of them"
                )
            _handlers[key] = spec
        return fn

    return register


def _path(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def unregister(name: str) -> None:
    """Remove a handler (tests and late-subscriber scenarios)."""
    with _lock:
        _handlers.pop(name, None)


def handlers() -> list[Handler]:
    """Every registered handler."""
    with _lock:
        return list(_handlers.values())


_publishers: dict[tuple[str, str], Publisher] = {}


def publishers() -> list[Publisher]:
    """One publisher per ``OUTBOX_PUBLISHERS`` entry, built on first use.

    Raises:
        ImproperlyConfigured: an entry's ``BACKEND`` cannot be imported or
            rejects its options.
    """
    from .publishers.base import build_publisher

    configured: Mapping[str, Mapping[str, Any]] = outbox_settings.PUBLISHERS
    result = []
    with _lock:
        for key, options in configured.items():
            cache_key = (key, repr(sorted(options.items())))
            publisher = _publishers.get(cache_key)
            if publisher is None:
                publisher = _publishers[cache_key] = build_publisher(key, options)
            result.append(publisher)
    return result


def close_publishers() -> None:
    """Close every publisher built so far and forget them (a relay shutting down;
    tests changing ``OUTBOX_PUBLISHERS``)."""
    with _lock:
        built = list(_publishers.values())
        _publishers.clear()
    for publisher in built:
        publisher.close()


def subscribers(kind: Kind | None = None) -> list[Subscriber]:
    """Every subscriber, or only handlers / only publishers."""
    found: list[Subscriber] = []
    if kind in (None, "handler"):
        found.extend(handlers())
    if kind in (None, "publisher"):
        found.extend(publishers())
    return found


def get(name: str) -> Subscriber:
    """The subscriber stored under ``name`` (its own name or an alias).

    Raises:
        UnknownSubscriber: no handler or publisher has that name.
    """
    for subscriber in subscribers():
        if name in subscriber.stored_names:
            return subscriber
    raise UnknownSubscriber(f"no handler or publisher is named {name!r}")
