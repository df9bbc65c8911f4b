"""The wire format: one outbox event as a CloudEvents 1.0 JSON envelope.

Publishers send events in the CloudEvents *structured content mode*: the whole
event, attributes and data, is one JSON document and the message's content type
is :data:`CONTENT_TYPE` (CloudEvents JSON Event Format, section 3,
https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/formats/json-format.md).

The envelope of an ``OrderPlaced`` event published for ``shop.Order`` 42::

    {
      "specversion": "1.0",
      "datacontenttype": "application/json",
      "id": "0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10",
      "source": "shop",
      "type": "OrderPlaced",
      "subject": "42",
      "time": "2025-06-01T12:00:00.123456Z",
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
attribute either has a value or is absent. Which field each attribute comes
from, and how the inbox reads it back, is one table:
:data:`outbox_app.events.cloudevents.ATTRIBUTES`.
"""

from __future__ import annotations

from typing import Any

from ..events.cloudevents import CONTENT_TYPE, rfc3339, write
from ..events.codec import dumps
from ..subscribers import DeliveryContext

__all__ = ["CONTENT_TYPE", "body", "rfc3339", "to_cloudevent"]


def to_cloudevent(context: DeliveryContext) -> dict[str, Any]:
    """Build the CloudEvents 1.0 structured-mode envelope of one delivery.

    Context attributes (CloudEvents core spec v1.0.2,
    https://github.com/cloudevents/spec/blob/v1.0.2/cloudevents/spec.md;
    each attribute's field in :data:`~outbox_app.events.cloudevents.ATTRIBUTES`):

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
    return write(context)


def body(context: DeliveryContext) -> bytes:
    """The envelope of :func:`to_cloudevent` as compact UTF-8 JSON
    (:func:`~outbox_app.events.codec.dumps`): the message body publishers
    send.

    Raises:
        ValueError: no event type (see :func:`to_cloudevent`).
    """
    return dumps(to_cloudevent(context))
