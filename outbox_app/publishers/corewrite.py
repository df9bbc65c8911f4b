"""The CoreWrite wire format: one outbox event as the JSON object a CoreWrite
subscriber reads (``event.EVENT_TYPE``, ``event.AGGREGATE_ID``,
``event.PAYLOAD``, ``event.USER``, ``event.METADATA``).

A publisher sends it with ``"FORMAT": "corewrite"``; the body of a tracked
update of ``Product`` 123 (``@track(aggregate_type="PRD")``)::

    {
      "OUTBOX_ID": "0190b6f0-6d2c-7cc1-8e4a-3f1c2b9d7a10",
      "EVENT_TYPE": "ProductUpdated",
      "AGGREGATE_ID": "123",
      "AGGREGATE_TYPE": "PRD",
      "OPERATION": "PATCH",
      "PAYLOAD": {"id": 123, "price": "89.99"},
      "PREVIOUS_PAYLOAD": {"price": "99.99"},
      "METADATA": {"method": "PATCH", "path": "/products/123"},
      "USER": "7",
      "CREATED_AT": "20251219170000",
      "STATUS": "PUBLISHED"
    }

Keys, always these (``PREVIOUS_PAYLOAD`` on updates only):

- ``OUTBOX_ID`` the event id (the deduplication key); ``EVENT_TYPE``;
  ``AGGREGATE_ID`` (text) and ``AGGREGATE_TYPE``, null without an aggregate;
- ``OPERATION``: ``POST`` (create, and an event published without an
  operation: a new fact), ``PATCH`` (update), ``DELETE`` (delete and soft
  delete); another operation given to ``publish()`` is sent upper-cased;
- ``PAYLOAD``: a tracked create's every tracked value, an update's changed
  values, a delete's last values, each with the primary key, keyed by
  attribute name; the payload of any other event as published;
- ``PREVIOUS_PAYLOAD``: an update's previous values of the changed fields;
- ``METADATA``: the ``acting()`` metadata, ``{}`` without; a tracked
  change shrunk to fit ``OUTBOX_MAX_PAYLOAD_BYTES`` adds ``"omitted"``, the
  names of the fields it left out of ``PAYLOAD`` and ``PREVIOUS_PAYLOAD``
  (sorted; over an ``acting()`` key of that name): the subscriber reads
  them from the source. ``USER``: the actor as text, or null;
- ``CREATED_AT``: when the event was published, ``YYYYMMDDHHMMSS`` in UTC;
  ``STATUS``: ``"PUBLISHED"``.

Content type ``application/json``.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

from ..events.codec import dumps
from ..subscribers import DeliveryContext

CONTENT_TYPE = "application/json"
#: outbox_app's operation -> CoreWrite's.
OPERATIONS = {
    "create": "POST",
    "update": "PATCH",
    "delete": "DELETE",
    "soft_delete": "DELETE",
}


def operation(value: str | None) -> str:
    """CoreWrite's ``OPERATION`` for outbox_app's ``operation``."""
    if value is None:
        return "POST"
    return OPERATIONS.get(value, value.upper())


def to_corewrite(context: DeliveryContext) -> dict[str, Any]:
    """The CoreWrite object of one delivery (see the module docstring).

    Raises:
        ValueError: no event type (an action's sentinel row is not an event).
    """
    if not context.event_type:
        raise ValueError(f"outbox event {context.event_id} has no event type")
    headers = context.headers or {}
    actor = headers.get("actor")
    event: dict[str, Any] = {
        "OUTBOX_ID": str(context.event_id),
        "EVENT_TYPE": context.event_type,
        "AGGREGATE_ID": context.aggregate_id,
        "AGGREGATE_TYPE": context.aggregate_type,
        "OPERATION": operation(context.operation),
        "PAYLOAD": context.payload,
    }
    metadata = headers.get("metadata") or {}
    tracked = _tracked(context)
    if tracked is not None:
        event.update(tracked)
        if context.payload.get("omitted"):
            metadata = {**metadata, "omitted": context.payload["omitted"]}
    event["METADATA"] = metadata
    event["USER"] = (
        None
        if actor is None
        else actor
        if isinstance(actor, str)
        else json.dumps(actor, separators=(",", ":"), default=str)
    )
    moment = context.occurred_at.astimezone(datetime.UTC)
    event["CREATED_AT"] = moment.strftime("%Y%m%d%H%M%S")
    event["STATUS"] = "PUBLISHED"
    return event


def body(context: DeliveryContext) -> bytes:
    """:func:`to_corewrite` as compact UTF-8 JSON
    (:func:`~outbox_app.events.codec.dumps`)."""
    return dumps(to_corewrite(context))


def _tracked(context: DeliveryContext) -> dict[str, Any] | None:
    """``PAYLOAD`` (and ``PREVIOUS_PAYLOAD``) of a tracked model's change
    event, whose payload is ``{"pk", "values"}`` or ``{"pk", "changed",
    "previous"}``; None for any other event."""
    payload = context.payload
    if context.operation not in OPERATIONS or "pk" not in payload:
        return None
    from ..publishing.tracking import primary_key_name

    key = {primary_key_name(context.aggregate_type): payload["pk"]}
    if context.operation == "update" and "changed" in payload:
        return {
            "PAYLOAD": {**key, **payload["changed"]},
            "PREVIOUS_PAYLOAD": payload.get("previous", {}),
        }
    if "values" in payload:
        return {"PAYLOAD": {**key, **payload["values"]}}
    return None
