"""CloudEvents 1.0 in JSON (structured content mode): the one table of the
attributes outbox_app writes and reads, and both directions derived from it.

Each :class:`Attribute` of :data:`ATTRIBUTES` names the field of a delivery's
context it is written from (:class:`~outbox_app.subscribers.DeliveryContext`),
the field of a consumer's context it is read back into
(:class:`~outbox_app.inbox.ConsumeContext`), how its value is written and
read, and whether the inbox keeps it in a column of its own. Publishers write
an event with :func:`write` (``publishers/cloudevents.py``); the inbox reads a
message with :func:`parse` and :func:`read`, and stores the columns of
:data:`COLUMNS`. A new attribute is one more row of the table.

Specs: the core attributes and naming rules,
https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md; the JSON
event format (structured mode),
https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass
from typing import Any, Literal

import orjson

from ..exceptions import UndecodableMessage

SPECVERSION = "1.0"
#: The message content type of a structured-mode CloudEvent in JSON.
CONTENT_TYPE = "application/cloudevents+json"
#: The content type of ``data``: the stored payload is JSON.
DATA_CONTENT_TYPE = "application/json"
#: The attributes every CloudEvent has (core spec, "Required Attributes").
REQUIRED = ("specversion", "id", "source", "type")

Kind = Literal["text", "int", "time", "data", "header"]


@dataclass(frozen=True)
class Attribute:
    """One CloudEvents attribute and the fields that carry it.

    Attributes:
        name: its name on the wire: lowercase ASCII letters and digits (core
            spec, "Attribute Naming Convention").
        field: the :class:`~outbox_app.subscribers.DeliveryContext` field it
            is written from; for a ``"header"``, the key of the context's
            ``headers`` (the same key in a consumer's ``headers``).
        kind: how its value is written and read back. ``"text"``: written
            as ``str(value)`` (a UUID as its text), read as it is;
            ``"int"``: as it is, read back only when an integer (else
            ``default``); ``"time"``: RFC 3339 in UTC (:func:`rfc3339`),
            read as an aware datetime (:func:`parse_time`; None when
            malformed); ``"data"``: the JSON value as it is, both ways;
            ``"header"``: a header's value as text (a string as it is, any
            other JSON value as its compact JSON text; an empty object or
            array is left out), read back when it is a string.
        received: the :class:`~outbox_app.inbox.ConsumeContext` field it is
            read into; default ``field`` (a header: into ``headers``).
        stored: the inbox keeps it in the
            :class:`~outbox_app.store.models.InboxMessage` column named as
            ``received`` (its key and what an operator searches).
        default: what the inbox reads when it is absent or not of its kind.
    """

    name: str
    field: str
    kind: Kind = "text"
    received: str = ""
    stored: bool = False
    default: Any = None

    def __post_init__(self):
        if not self.received:
            object.__setattr__(self, "received", self.field)

    def read(self, value: Any) -> Any:
        """The attribute's JSON ``value`` (None: absent) as its field's."""
        if self.kind == "int":
            return value if isinstance(value, int) else self.default
        if self.kind == "time":
            return parse_time(value)
        if self.kind == "header":
            return value if isinstance(value, str) else None
        return self.default if value is None else value


#: Every attribute outbox_app writes beside ``specversion`` and
#: ``datacontenttype``, in the order of the envelope.
ATTRIBUTES: tuple[Attribute, ...] = (
    # The event id (UUIDv7 as text): unique per source, the inbox's key.
    Attribute("id", "event_id", received="message_id", stored=True),
    Attribute("source", "namespace", received="source", stored=True),
    Attribute("type", "event_type", stored=True),
    Attribute("subject", "aggregate_id", stored=True),
    Attribute("time", "occurred_at", "time"),
    Attribute("data", "payload", "data"),
    # outbox_app's own extensions.
    Attribute("revision", "revision", "int", default=1),
    Attribute("aggregatetype", "aggregate_type", stored=True),
    Attribute("aggregateversion", "aggregate_version", "int"),
    Attribute("tenantid", "tenant_id"),
    Attribute("actionid", "action_id"),
    Attribute("deliverat", "deliver_at", "time"),
    # CloudEvents' expiry extension.
    Attribute("expiretime", "expires_at", "time"),
    Attribute("operation", "operation"),
    # From the headers given to publish(): extension names have no
    # underscores (core spec, "Attribute Naming Convention").
    Attribute("correlationid", "correlation_id", "header"),
    Attribute("causationid", "causation_id", "header"),
    # The distributed-tracing extension (W3C Trace Context), set by publish()
    # under OpenTelemetry (execution/tracing.py).
    Attribute("traceparent", "traceparent", "header"),
    Attribute("tracestate", "tracestate", "header"),
    # Who acted and the acting block's metadata (acting()).
    Attribute("actor", "actor", "header"),
    Attribute("metadata", "metadata", "header"),
)

#: CloudEvents attribute -> the InboxMessage column that stores it.
COLUMNS = {a.name: a.received for a in ATTRIBUTES if a.stored}


def write(context: Any) -> dict[str, Any]:
    """The CloudEvents envelope of ``context`` (a
    :class:`~outbox_app.subscribers.DeliveryContext`): ``specversion``,
    ``datacontenttype`` and each attribute of :data:`ATTRIBUTES` that has a
    value, as JSON types: each kind's writer of :data:`_WRITERS` (a
    writer's None leaves the attribute out), from the table compiled once
    (:data:`_PLAN`: this runs once per message a publisher sends)."""
    headers = context.headers or {}
    envelope: dict[str, Any] = {
        "specversion": SPECVERSION,
        "datacontenttype": DATA_CONTENT_TYPE,
    }
    for name, field, header, convert in _PLAN:
        value = headers.get(field) if header else getattr(context, field)
        if value is not None:
            if convert is not None:
                value = convert(value)
                if value is None:
                    continue
            envelope[name] = value
    return envelope


def read(envelope: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~outbox_app.inbox.ConsumeContext` fields of ``envelope``
    (from :func:`parse`) that :data:`ATTRIBUTES` carry, ``headers``
    included."""
    fields: dict[str, Any] = {}
    headers: dict[str, str] = {}
    for attribute in ATTRIBUTES:
        value = attribute.read(envelope.get(attribute.name))
        if attribute.kind != "header":
            fields[attribute.received] = value
        elif value is not None:
            headers[attribute.received] = value
    fields["headers"] = headers
    return fields


def _text(value: Any) -> str:
    """A header's value as an extension attribute's text (extension
    attributes are scalars: core spec, "Type System"): a string as it is,
    any other JSON value as its compact JSON text, anything else as
    ``str()``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict | list | bool | int | float):
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    return str(value)


def parse(body: bytes | str) -> dict[str, Any]:
    """The CloudEvent in a structured-mode JSON message body: the inverse of
    the publishers' body (``manage.py consume`` reads what they send).

    Returns:
        The envelope, a dict with at least the required attributes, as strings.

    Raises:
        UndecodableMessage: not JSON, not an object, a required attribute
            missing or not a non-empty string, or a ``specversion`` other
            than ``"1.0"`` (another version's attributes mean other things:
            0.3's ``schemaurl`` and ``datacontentencoding``, say).
    """
    try:
        envelope = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise UndecodableMessage(f"the message body is not JSON: {exc}") from exc
    if not isinstance(envelope, dict):
        raise UndecodableMessage(
            f"the message body is a JSON {type(envelope).__name__}, not a "
            "CloudEvents object"
        )
    missing = [
        name
        for name in REQUIRED
        if not isinstance(envelope.get(name), str) or not envelope[name]
    ]
    if missing:
        raise UndecodableMessage(
            f"not a CloudEvent: no {', '.join(missing)} (a string each); "
            f"attributes: {', '.join(sorted(envelope)) or 'none'}"
        )
    if envelope["specversion"] != SPECVERSION:
        raise UndecodableMessage(
            f"specversion is {envelope['specversion']!r}; the inbox reads "
            f"CloudEvents {SPECVERSION} only"
        )
    return envelope


def parse_time(value: Any) -> datetime.datetime | None:
    """An RFC 3339 attribute (``time``, ``expiretime``) as an aware datetime;
    None when absent or malformed (a foreign producer's problem, not a reason
    to refuse its event)."""
    if not isinstance(value, str):
        return None
    try:
        moment = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return moment if moment.tzinfo else moment.replace(tzinfo=datetime.UTC)


def rfc3339(moment: datetime.datetime) -> str:
    """``moment`` as an RFC 3339 UTC timestamp, e.g. ``2025-06-01T12:00:00.500000Z``.

    A naive datetime is taken to be UTC (Django stores UTC when ``USE_TZ``).
    Microseconds are kept when present.
    """
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    text = moment.astimezone(datetime.UTC).isoformat()
    return text.removesuffix("+00:00") + "Z"


def _header(value: Any) -> str | None:
    return None if value in ({}, []) else _text(value)


#: How each kind of attribute writes a value that is not None (None: as it is).
_WRITERS: dict[str, Any] = {
    "text": str,
    "int": None,
    "time": rfc3339,
    "data": None,
    "header": _header,
}
#: :data:`ATTRIBUTES` as :func:`write` reads them: ``(name, field, is a
#: header, how its value is written)``.
_PLAN = tuple(
    (a.name, a.field, a.kind == "header", _WRITERS[a.kind]) for a in ATTRIBUTES
)
