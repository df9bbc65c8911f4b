"""The ``Event`` base class and the registry of event types and upcasters.

An event is a frozen dataclass subclassing :class:`Event`::

    @dataclass(frozen=True)
    class OrderPlaced(Event):
        order_id: int
        total: Decimal

Its ``event_type`` is the class's simple name (``"OrderPlaced"``), not its
dotted path, so moving the module does not change the stored contract; two
classes with one type name are a configuration error. ``revision`` is the
payload schema version: an old revision is brought up to date by the
functions registered with :func:`upcaster` before a handler sees it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from ..exceptions import (
    DuplicateEventType,
    InvalidEventType,
)
from .text import require_storable

MAX_EVENT_TYPE_LENGTH = 255


_registry: dict[str, type[Event]] = {}


_upcasters: dict[tuple[str, int], Callable[[dict[str, Any]], dict[str, Any]]] = {}


class Event:
    """Base class for integration events (use it with ``@dataclass(frozen=True)``).

    Class attributes:
        event_type (str): the stored type name; defaults to the class's simple
            name. Override it to keep a contract stable across a rename.
        revision (int): payload schema version, default 1. Bump it when the
            payload changes incompatibly and register an :func:`upcaster`.

    Raises:
        DuplicateEventType: at class creation, when another class already owns the
            same ``event_type`` in this process.
        InvalidEventType: at class creation, for an empty or over-long type name.
    """

    event_type: ClassVar[str]
    revision: ClassVar[int] = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "event_type" not in cls.__dict__:
            cls.event_type = cls.__name__
        validate_event_type(cls.event_type)
        existing = _registry.get(cls.event_type)
        if existing is not None and _path(existing) != _path(cls):
            raise DuplicateEventType(
                f"Event type {cls.event_type!r} is defined by both {_path(existing)} "
                f"and {_path(cls)}. Rename one class or set event_type on it."
            )
        _registry[cls.event_type] = cls


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def validate_event_type(event_type: object) -> str:
    """Return ``event_type`` if it is a usable type name.

    Raises:
        InvalidEventType: not a string, empty, longer than 255 characters, or
            holding a NUL character or a lone surrogate (no database column or
            UTF-8 message can carry them).
    """
    if not isinstance(event_type, str) or not event_type.strip():
        raise InvalidEventType(
            f"event_type must be a non-empty string, got {event_type!r}"
        )
    return require_storable(
        event_type, "event_type", MAX_EVENT_TYPE_LENGTH, InvalidEventType
    )


def event_class(event_type: str) -> type[Event] | None:
    """The :class:`Event` subclass registered for ``event_type``, or ``None``."""
    return _registry.get(event_type)


def registered_event_types() -> frozenset[str]:
    """Every event type defined by an :class:`Event` subclass in this process."""
    return frozenset(_registry)


def upcaster(
    event: type[Event] | str, from_revision: int
) -> Callable[[Callable[[dict], dict]], Callable[[dict], dict]]:
    """Register ``fn(payload) -> payload`` turning revision ``from_revision`` of
    ``event`` into revision ``from_revision + 1``.

    Upcasters chain: a revision-1 row of a revision-3 class goes through the 1->2
    and 2->3 functions before the class is built: stored rows are never
    rewritten, old revisions are upgraded as they are read.
    """
    event_type = event if isinstance(event, str) else event.event_type

    def register(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        _upcasters[(event_type, from_revision)] = fn
        return fn

    return register
