"""Events: the ``Event`` base class, the type registry, payload encoding and
revisions.

An event is a frozen dataclass subclassing :class:`Event`::

    @dataclass(frozen=True)
    class OrderPlaced(Event):
        order_id: int
        total: Decimal

Its ``event_type`` is the class's simple name (``"OrderPlaced"``), not its dotted
path, so moving the module does not change the stored contract (Ekbatan, seed
000). ``revision`` is the payload schema version (tiny-blocks/outbox, seed 002);
an old revision is brought up to date by the functions registered with
:func:`upcaster` before a handler sees it.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import functools
import json
import re
import types
import typing
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.dateparse import (
    parse_date,
    parse_datetime,
    parse_duration,
    parse_time,
)

from .exceptions import (
    DuplicateEventType,
    EventDecodeError,
    InvalidEvent,
    InvalidEventType,
    InvalidPayload,
    PayloadTooLarge,
)

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


def unstorable(value: Any, max_length: int) -> str | None:
    """Why ``value`` cannot be stored unchanged, on every database, in a text
    column of ``max_length`` characters, or None: the one rule for the short
    texts outbox_app stores as they are (an event's type, aggregate type and
    id, tenant, operation, action name; a consumed CloudEvent's id, source,
    type, subject). About 0.1 microsecond for ASCII text.

    A NUL character (PostgreSQL refuses it, MariaDB and SQLite would keep it),
    a lone surrogate (not Unicode text: no driver encodes it), or more than
    ``max_length`` characters (PostgreSQL and MariaDB refuse it, SQLite would
    keep it); a value that is not a string at all.
    """
    if not isinstance(value, str):
        return f"is not a string ({type(value).__name__})"
    if "\x00" in value:
        return "holds a NUL character"
    if not (value.isascii() or _encodable(value)):
        return "holds a lone surrogate"
    if len(value) > max_length:
        return f"is {len(value)} characters long (the limit is {max_length})"
    return None


def require_storable(
    text: str, what: str, max_length: int, error: type[InvalidEvent] = InvalidEvent
) -> str:
    """Return ``text`` if :func:`unstorable` finds nothing wrong with it.

    Raises:
        error (InvalidEvent): it cannot be stored unchanged; the message names
            ``what`` and why.
    """
    problem = unstorable(text, max_length)
    if problem:
        raise error(f"{what} {problem}: {text!a:.60}; nothing was written")
    return text


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


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
    and 2->3 functions before the class is built (seed 002's read-side upcasting).
    """
    event_type = event if isinstance(event, str) else event.event_type

    def register(fn: Callable[[dict], dict]) -> Callable[[dict], dict]:
        _upcasters[(event_type, from_revision)] = fn
        return fn

    return register


# --- encoding ----------------------------------------------------------------------


class OutboxJSONEncoder(DjangoJSONEncoder):
    """``DjangoJSONEncoder`` without its millisecond rounding: datetimes and times
    keep their microseconds, so a decoded event equals the published one."""

    def default(self, o: Any) -> Any:
        if isinstance(o, datetime.datetime | datetime.time):
            if isinstance(o, datetime.time) and o.utcoffset() is not None:
                raise ValueError("JSON can't represent timezone-aware times.")
            text = o.isoformat()
            return text[:-6] + "Z" if text.endswith("+00:00") else text
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            return _fields_of(o)  # a nested dataclass, as dataclasses.asdict
        return super().default(o)


def _fields_of(instance: Any) -> dict[str, Any]:
    """A dataclass instance's fields, one level deep: the encoder turns nested
    dataclasses into objects as it meets them (``dataclasses.asdict`` copies
    the whole tree first, which was most of an encode)."""
    return {name: getattr(instance, name) for name in _field_names(type(instance))}


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


#: One encoder for every payload (``json.dumps(..., cls=...)`` builds one per
#: call): the separators of ``json.dumps``, NaN refused, text left as UTF-8
#: (so the size is the stored size, and a lone surrogate, which no JSON column
#: or UTF-8 wire format can carry, is found by encoding it).
_ENCODER = OutboxJSONEncoder(allow_nan=False, ensure_ascii=False)


@dataclasses.dataclass(frozen=True)
class EncodedEvent:
    """An event ready for the outbox row: type, revision and a JSON-safe payload."""

    event_type: str
    revision: int
    payload: dict[str, Any]
    id: uuid.UUID | None = None
    #: ``payload`` as the JSON text that is stored.
    payload_text: str = "{}"


def encode(event: Event | Mapping[str, Any], max_bytes: int) -> EncodedEvent:
    """Validate and encode one event for storage.

    Args:
        event: an :class:`Event` dataclass instance, or a mapping
            ``{"event_type": str, "payload": dict, "revision": int, "id": UUID}``
            (``revision`` and ``id`` optional; a caller-chosen ``id`` makes a
            retried publish idempotent: the second one raises
            ``DuplicateOutboxEvent``).
        max_bytes: largest encoded payload accepted, in bytes (UTF-8 JSON).

    Returns:
        EncodedEvent whose payload holds only JSON types (Decimal, datetime, date,
        time, timedelta and UUID become strings, as ``DjangoJSONEncoder`` writes
        them, but with full microsecond precision).

    Raises:
        InvalidEventType: bad type name.
        InvalidPayload: not a dataclass or mapping, or a field that JSON cannot
            encode (``.field`` names it).
        PayloadTooLarge: the encoded payload exceeds ``max_bytes``.
    """
    event_id = None
    if isinstance(event, Event) and dataclasses.is_dataclass(event):
        event_type, revision = type(event).event_type, type(event).revision
        payload = _fields_of(event)
    elif isinstance(event, Mapping):
        event_type = event.get("event_type")
        revision = event.get("revision", 1)
        payload = event.get("payload", {})
        event_id = event.get("id")
        if event_id is not None and not isinstance(event_id, uuid.UUID):
            try:
                event_id = uuid.UUID(str(event_id))
            except ValueError:
                raise InvalidPayload(f"id must be a UUID, got {event_id!r}") from None
        if not isinstance(payload, Mapping):
            raise InvalidPayload(
                f"payload of {event_type!r} must be a mapping, got "
                f"{type(payload).__name__}"
            )
    else:
        raise InvalidPayload(
            f"expected an Event dataclass instance or a mapping with 'event_type', "
            f"got {type(event).__name__}"
        )
    validate_event_type(event_type)
    if not isinstance(revision, int) or revision < 1:
        raise InvalidPayload(f"revision must be a positive integer, got {revision!r}")
    decoded, text = to_json(payload, event_type, max_bytes)
    return EncodedEvent(event_type, revision, decoded, event_id, text)


def to_json(
    data: Mapping[str, Any], label: str, max_bytes: int
) -> tuple[dict[str, Any], str]:
    """``data`` as plain JSON types, the way ``DjangoJSONEncoder`` writes it.

    Args:
        data: the mapping to encode.
        label: what it is, for error messages (an event type, "headers").
        max_bytes: largest encoded size accepted, in bytes (UTF-8 JSON).

    Returns:
        ``(plain JSON types, their JSON text)``: the text is what is stored.

    Raises:
        InvalidPayload: a value JSON cannot encode (``.field`` names its key),
            a lone surrogate or NUL character, or objects and arrays nested
            more than :data:`MAX_JSON_DEPTH` levels deep.
        PayloadTooLarge: the encoding is larger than ``max_bytes``.
    """
    too_deep = InvalidPayload(
        f"{label} is nested more than {MAX_JSON_DEPTH} levels deep: MariaDB's JSON "
        "columns refuse it, so it is refused on every database"
    )
    try:
        text = _ENCODER.encode(data)
    except RecursionError as exc:
        raise too_deep from exc
    except (TypeError, ValueError) as exc:
        field = _offending_field(data)
        raise InvalidPayload(
            f"{label}.{field} is not JSON-serialisable: {exc}", field=field
        ) from exc
    try:
        size = len(text.encode())
    except UnicodeEncodeError as exc:
        field = _field_holding(json.loads(text), _unencodable)
        raise InvalidPayload(
            f"{label}.{_shown(field)} holds a lone surrogate "
            f"({text[exc.start : exc.end]!a}), which is not Unicode text and cannot "
            "be stored or sent as UTF-8 JSON",
            field=field,
        ) from exc
    if size > max_bytes:
        raise PayloadTooLarge(
            f"{label} payload is {size} bytes; OUTBOX_MAX_PAYLOAD_BYTES is {max_bytes}"
        )
    # A nesting deeper than the limit needs more opening brackets than that
    # (counted at C speed); only then is the decoded value walked.
    deep = text.count("{") + text.count("[") > MAX_JSON_DEPTH
    try:
        decoded = loads(text)
    except RecursionError as exc:
        raise too_deep from exc
    if deep and _depth(decoded) > MAX_JSON_DEPTH:
        raise too_deep
    # JSON escapes NUL as \u0000: only then look for the field holding it.
    field = _field_holding(decoded, _has_nul) if "\\u0000" in text else None
    if field is not None:
        # PostgreSQL's jsonb refuses NUL characters; refuse them everywhere.
        raise InvalidPayload(
            f"{label}.{_shown(field)} contains a NUL character, which JSON "
            "columns cannot store",
            field=field,
        )
    return decoded, text


#: Deepest nesting of objects and arrays a payload or headers may have: what
#: MariaDB's JSON columns accept (its ``JSON_VALID`` check refuses deeper
#: documents), so a payload stored on one database is stored on all three.
MAX_JSON_DEPTH = 31


def _depth(value: Any) -> int:
    """How deeply ``value``'s objects and arrays nest (a scalar: 0), without
    recursion."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        stack.extend((child, level + 1) for child in children)
    return deepest


def _field_holding(decoded: dict[str, Any], bad: Callable[[str], bool]) -> str | None:
    """The first key of the JSON object ``decoded`` whose key, or any text
    in whose value, is ``bad``."""
    for key, value in decoded.items():
        if _holds(key, bad) or _holds(value, bad):
            return key
    return None


def _holds(value: Any, bad: Callable[[str], bool]) -> bool:
    """Whether a text of the JSON value ``value`` (keys included) is ``bad``,
    without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if bad(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _shown(key: str | None) -> str:
    """``key`` for a message: as it is, or escaped if it holds what a log
    line should not (NUL, a lone surrogate, other control characters)."""
    if key is None or (key.isprintable() and _encodable(key)):
        return str(key)
    return ascii(key)


def _has_nul(text: str) -> bool:
    return "\x00" in text


def _unencodable(text: str) -> bool:
    return not _encodable(text)


def _offending_field(payload: Mapping[str, Any]) -> str | None:
    for key, value in payload.items():
        try:
            json.dumps(value, cls=OutboxJSONEncoder, allow_nan=False)
        except (TypeError, ValueError):
            return str(key)
    return None


def loads(text: str) -> Any:
    """Parse stored JSON text (a payload, headers) exactly as ``json.loads``
    would, with orjson's speed (about 8x) where that is the same thing: text
    holding a run of 19 or more digits (an integer orjson would turn into a
    float) or that orjson refuses (a lone surrogate) goes to ``json.loads``."""
    if not _LONG_NUMBER.search(text):
        try:
            return orjson.loads(text)
        except orjson.JSONDecodeError:
            pass
    return json.loads(text)


_LONG_NUMBER = re.compile(r"\d{19}")


# --- decoding ----------------------------------------------------------------------


def decode(event_type: str, revision: int, payload: dict[str, Any]) -> Any:
    """Rebuild the event a handler receives from a stored row.

    Args:
        event_type: the stored type name.
        revision: the stored payload revision.
        payload: the stored JSON payload.

    Returns:
        An instance of the registered :class:`Event` class, equal to the one
        published; field values are converted back from their JSON form by the
        field's type hint (Decimal, datetime, date, time, timedelta, UUID, nested
        dataclasses, lists and optionals of those).

    Raises:
        EventDecodeError: no class for the type, a revision with no upcaster, a
            revision newer than the class, or a payload that does not fit the class.
    """
    cls = _registry.get(event_type)
    if cls is None:
        raise EventDecodeError(f"no Event class defines event type {event_type!r}")
    if revision > cls.revision:
        raise EventDecodeError(
            f"{event_type} row has revision {revision}, newer than the class's "
            f"revision {cls.revision}: deploy the newer code"
        )
    data = dict(payload)
    for rev in range(revision, cls.revision):
        step = _upcasters.get((event_type, rev))
        if step is None:
            raise EventDecodeError(
                f"{event_type} revision {rev} has no upcaster to revision {rev + 1}"
            )
        data = step(data)
    try:
        return _build(cls, data)
    except (TypeError, ValueError, decimal.InvalidOperation) as exc:
        raise EventDecodeError(
            f"stored {event_type} payload does not fit {_path(cls)}: {exc}"
        ) from exc


def _build(cls: type, data: Mapping[str, Any]) -> Any:
    if not isinstance(data, Mapping):
        raise TypeError(f"expected an object for {cls.__name__}, got {data!r}")
    converters, fields = _schema(cls)
    unknown = data.keys() - fields
    if unknown:
        raise TypeError(f"unexpected field(s) {', '.join(sorted(unknown))}")
    return cls(
        **{k: v if v is None else converters.get(k, _same)(v) for k, v in data.items()}
    )


@functools.cache
def _schema(cls: type) -> tuple[dict[str, Callable[[Any], Any]], frozenset[str]]:
    """A dataclass's field converters (from its type hints) and init field
    names, worked out once per class (``typing.get_type_hints`` and walking
    the hints were most of the cost of a decode)."""
    fields = frozenset(f.name for f in dataclasses.fields(cls) if f.init)
    hints = typing.get_type_hints(cls)
    return {name: _converter(hint) for name, hint in hints.items()}, fields


_PARSERS: dict[type, Callable[[Any], Any]] = {
    decimal.Decimal: lambda v: decimal.Decimal(str(v)),
    uuid.UUID: lambda v: uuid.UUID(str(v)),
    datetime.datetime: parse_datetime,
    datetime.date: parse_date,
    datetime.time: parse_time,
    datetime.timedelta: parse_duration,
}


def _same(value: Any) -> Any:
    return value


def _converter(hint: Any) -> Callable[[Any], Any]:
    """The function that turns a non-None JSON value back into ``hint``'s type
    (Decimal, datetime, date, time, timedelta, UUID, nested dataclasses, lists
    and optionals of those); other values pass through unchanged."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        return _converter(options[0]) if len(options) == 1 else _same
    if origin in (list, tuple, set, frozenset):
        args = typing.get_args(hint)
        item = _converter(args[0] if args else Any)
        return lambda value: origin(None if v is None else item(v) for v in value)
    if isinstance(hint, type):
        if dataclasses.is_dataclass(hint):
            return lambda value: _build(hint, value)
        parser = _PARSERS.get(hint)
        if parser is not None:
            return functools.partial(_parse, parser, hint)
    return _same


def _parse(parser: Callable[[Any], Any], hint: type, value: Any) -> Any:
    if not isinstance(value, str | int | float):
        return value
    parsed = parser(value)
    if parsed is None:
        raise ValueError(f"{value!r} is not a valid {hint.__name__}")
    return parsed
