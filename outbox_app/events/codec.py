"""Payloads as JSON: encoding an event for the outbox (checked before the
INSERT: JSON types only, no NUL or lone surrogate, within the size limit)
and decoding a stored payload back into its event, through the upcasters of
older revisions."""

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
from typing import Any

import orjson
from django.core.serializers.json import DjangoJSONEncoder
from django.utils.dateparse import (
    parse_date,
    parse_datetime,
    parse_duration,
    parse_time,
)

from ..exceptions import (
    EventDecodeError,
    InvalidEvent,
    InvalidPayload,
    PayloadTooLarge,
)
from .text import _encodable
from .types import Event, _path, _registry, _upcasters, validate_event_type


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


#: The keys of an event given to ``publish()`` as a mapping.
EVENT_KEYS = frozenset({"event_type", "payload", "revision", "id"})


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
        InvalidEvent: a mapping with a key not in :data:`EVENT_KEYS` (a typo
            such as ``paylod``).
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
        unknown = sorted(map(str, set(event) - EVENT_KEYS))
        if unknown:
            raise InvalidEvent(
                f"an event mapping has unknown key(s) {unknown}; it takes "
                f"{sorted(EVENT_KEYS)} (the aggregate, headers and schedule are "
                "publish()'s arguments); nothing was written"
            )
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


def dumps(value: Any) -> bytes:
    """``value`` (plain JSON types, as payloads are stored) as compact UTF-8
    JSON: the bytes a message body carries. orjson (about 20x the standard
    library for an envelope: docs/performance.md, "Relay to RabbitMQ"); a
    value orjson refuses (an integer beyond 64 bits, which Python's ``json``
    stores) falls back to the standard library, so every stored payload is
    sent unchanged."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


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
