"""The wire format: one outbox event as a CloudEvents 1.0 JSON envelope.

Publishers send events in the CloudEvents *structured content mode*: the whole
event, attributes and data, is one JSON document and the message's content type
is :data:`CONTENT_TYPE` (CloudEvents JSON Event Format, section 3,
https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md).

The envelope of an ``OrderPlaced`` event published for ``shop.Order`` 42::

    {
      "specversion": "1.0",
      "id": "0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10",
      "source": "shop",
      "type": "OrderPlaced",
      "subject": "42",
      "time": "2025-06-01T12:00:00.123456Z",
      "datacontenttype": "application/json",
      "data": {"order_id": 42, "total": "19.90"},
      "revision": 1,
      "aggregatetype": "shop.Order",
      "aggregateversion": 3,
      "tenantid": "acme",
      "actionid": "0190b6f0-6d2b-7aa0-9b1e-5d2c4e6f8a01",
      "correlationid": "req-7f3a",
      "causationid": "0190b6f0-6d2a-7000-8000-000000000001",
      "actor": "7",
      "metadata": "{\\"path\\":\\"/orders/\\",\\"ip\\":\\"10.0.0.5\\"}"
    }

Attributes whose value is absent (no aggregate, no tenant, no header) are left
out rather than sent as ``null``: the spec (core, "Type System") says an
attribute either has a value or is absent.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import orjson

from ..events.codec import dumps
from ..exceptions import UndecodableMessage
from ..subscribers import DeliveryContext

SPECVERSION = "1.0"
#: The message content type of a structured-mode CloudEvent in JSON.
CONTENT_TYPE = "application/cloudevents+json"
#: The content type of ``data``: the stored payload is JSON.
DATA_CONTENT_TYPE = "application/json"

#: Extension attributes taken from ``DeliveryContext.headers``: header key to
#: attribute name. Extension names are lowercase ASCII letters and digits only
#: (CloudEvents core spec, "Attribute Naming Convention"), hence no underscores.
HEADER_EXTENSIONS = {
    "correlation_id": "correlationid",
    "causation_id": "causationid",
    # The distributed-tracing extension (W3C Trace Context), set by publish()
    # under OpenTelemetry (outbox_app/execution/tracing.py).
    "traceparent": "traceparent",
    "tracestate": "tracestate",
}


def to_cloudevent(context: DeliveryContext) -> dict[str, Any]:
    """Build the CloudEvents 1.0 structured-mode envelope of one delivery.

    Context attributes (CloudEvents core spec v1.0.2,
    https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md):

    * required: ``specversion`` ``"1.0"``; ``id`` the outbox event id (UUIDv7 as
      text; unique per ``source``, so consumers deduplicate on it); ``source``
      the namespace (``OUTBOX_NAMESPACE``); ``type`` the event type.
    * optional: ``subject`` the aggregate id; ``time`` when the event was
      published, RFC 3339 in UTC (``...Z``); ``datacontenttype``
      ``"application/json"``; ``data`` the stored payload.
    * extensions (outbox_app's own): ``revision`` (int, payload schema
      version), ``aggregatetype`` (model label), ``aggregateversion`` (int),
      ``tenantid``, ``actionid``, and ``correlationid`` / ``causationid`` from
      the ``correlation_id`` / ``causation_id`` headers; ``deliverat`` and
      ``expiretime`` (RFC 3339) from ``publish(deliver_at=...,
      expires_at=...)``, so a consumer can drop a message that arrives too
      late; ``operation`` (``publish(operation=...)``: create, update,
      delete, soft_delete for a tracked model); the distributed tracing
      extension's ``traceparent`` / ``tracestate`` from the headers of the
      same names; ``actor`` (who acted: :func:`~outbox_app.acting`'s actor, as
      text; a non-string actor as its JSON text) and ``metadata`` (the
      acting block's metadata, a JSON object as text). Other headers are not
      part of the envelope.

    Absent values are omitted, never ``null``.

    Args:
        context: the delivery; only the event's fields are used (not
            ``attempt``, ``subscriber`` or ``delivery_id``, so a redelivery
            is byte-for-byte the same event).

    Returns:
        A dict of JSON types, ready for ``json.dumps``.

    Raises:
        ValueError: no event type (an action's sentinel row is not an event).
    """
    if not context.event_type:
        raise ValueError(f"outbox event {context.event_id} has no event type")
    envelope: dict[str, Any] = {
        "specversion": SPECVERSION,
        "id": str(context.event_id),
        "source": context.namespace,
        "type": context.event_type,
        "subject": context.aggregate_id,
        "time": rfc3339(context.occurred_at),
        "datacontenttype": DATA_CONTENT_TYPE,
        "data": context.payload,
        "revision": context.revision,
        "aggregatetype": context.aggregate_type,
        "aggregateversion": context.aggregate_version,
        "tenantid": context.tenant_id,
        "actionid": None if context.action_id is None else str(context.action_id),
        "deliverat": None
        if context.deliver_at is None
        else rfc3339(context.deliver_at),
        "expiretime": (
            None if context.expires_at is None else rfc3339(context.expires_at)
        ),
        "operation": context.operation,
    }
    headers = context.headers or {}
    for key, attribute in HEADER_EXTENSIONS.items():
        value = headers.get(key)
        envelope[attribute] = None if value is None else str(value)
    actor, metadata = headers.get("actor"), headers.get("metadata")
    envelope["actor"] = None if actor is None else _text(actor)
    envelope["metadata"] = _text(metadata) if metadata else None
    return {name: value for name, value in envelope.items() if value is not None}


def _text(value: Any) -> str:
    """A header value as an extension attribute's text: a string as it is,
    any other JSON value as its compact JSON text (extension attributes are
    scalars: CloudEvents core spec, "Type System")."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)


def body(context: DeliveryContext) -> bytes:
    """The envelope of :func:`to_cloudevent` as compact UTF-8 JSON
    (:func:`~outbox_app.events.codec.dumps`): the message body publishers
    send.

    Raises:
        ValueError: no event type (see :func:`to_cloudevent`).
    """
    return dumps(to_cloudevent(context))


#: The attributes every CloudEvent has (core spec, "Required Attributes").
REQUIRED = ("specversion", "id", "source", "type")


def parse(body: bytes | str) -> dict[str, Any]:
    """The CloudEvent in a structured-mode JSON message body: the inverse of
    :func:`body` (``manage.py consume`` reads what publishers send).

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
