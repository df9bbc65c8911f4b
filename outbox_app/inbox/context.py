"""One received message as the inbox reads it: its body as bytes, the
CloudEvent it holds (:func:`~outbox_app.events.cloudevents.parse`), the
context a consumer receives (:func:`context_for`), the inbox row's columns
(:func:`columns_of`), and its key when it cannot be read (:func:`dead_key`).

A message that is not a CloudEvents 1.0 event (another ``specversion``
included), or whose attributes the inbox cannot store (``id``, ``source``,
``type``, ``subject``, ``aggregatetype``: not a string, holding NUL, longer
than the column), is :class:`~outbox_app.exceptions.UndecodableMessage`:
the inbox keeps it DEAD at once, keyed by :func:`dead_key`.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import uuid
from typing import Any

import orjson

from ..events.cloudevents import COLUMNS, parse_time, read
from ..events.text import unstorable
from ..exceptions import UndecodableMessage
from ..store.models import InboxMessage
from .registry import ConsumeContext, Consumer

logger = logging.getLogger("outbox_app.inbox")


def context_for(
    envelope: dict[str, Any], consumer: Consumer, queue: str, attempt: int
) -> ConsumeContext:
    """The context of ``envelope`` (a parsed CloudEvent) for ``consumer``:
    its attributes read back into their fields
    (:func:`~outbox_app.events.cloudevents.read`)."""
    fields_ = read(envelope)
    try:
        event_id = uuid.UUID(fields_["message_id"])
    except ValueError:
        event_id = None
    return ConsumeContext(
        **fields_,
        event_id=event_id,
        envelope=envelope,
        attempt=attempt,
        consumer=consumer.name,
        queue=queue,
    )


def published_at(context: ConsumeContext) -> datetime.datetime | None:
    """When ``context``'s event was published, or scheduled for."""
    return context.deliver_at or context.occurred_at


def as_bytes(body: bytes | str) -> bytes:
    """A body kombu handed over decoded, as bytes (a lone surrogate kept as
    bytes no UTF-8 decoder takes: the body is undecodable)."""
    return body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body


def columns_of(envelope: dict) -> dict[str, str]:
    """The inbox columns of ``envelope``'s attributes (:data:`COLUMNS`; an
    absent optional one: empty), and its ``body_digest``: the SHA-256 of
    the envelope as JSON with sorted keys, so the same CloudEvent spaced or
    ordered otherwise by its producer has the same one.

    Raises:
        UndecodableMessage: an attribute the inbox cannot store, named.
    """
    columns = {}
    for attribute, column in COLUMNS.items():
        value = envelope.get(attribute)
        value = "" if value is None else value
        problem = unstorable_in(value, column)
        if problem:
            raise UndecodableMessage(
                f"the inbox cannot store this CloudEvent: {attribute} {problem}"
            )
        columns[column] = value
    canonical = orjson.dumps(envelope, option=orjson.OPT_SORT_KEYS)
    columns["body_digest"] = hashlib.sha256(canonical).hexdigest()
    return columns


def unstorable_in(value: Any, column: str) -> str | None:
    """Why ``value`` cannot be stored in the InboxMessage ``column`` as it
    is (never silently changed: it is a key or what an operator looks for),
    or None."""
    return unstorable(value, InboxMessage._meta.get_field(column).max_length)


def dead_key(
    envelope: dict | None, body: bytes, message_id: str | None
) -> tuple[str, str]:
    """``(source, message id)`` of an undecodable message's rows: the
    CloudEvent's own when it has a usable pair, else the broker's message id
    with no source, else the body's SHA-256."""
    if envelope is not None and not (
        unstorable_in(envelope.get("source"), "source")
        or unstorable_in(envelope.get("id"), "message_id")
    ):
        return envelope["source"], envelope["id"]
    if message_id is not None and not unstorable_in(message_id, "message_id"):
        return "", message_id
    return "", hashlib.sha256(body).hexdigest()


def expired(envelope: dict, now: datetime.datetime) -> bool:
    """The message arrived after its ``expiretime``: its producer asked that
    it not be delivered any more (CloudEvents' expiry extension). Logged at
    DEBUG; the consume summary counts them."""
    expires = parse_time(envelope.get("expiretime"))
    if expires is None or expires > now:
        return False
    logger.debug(
        "message %s (%s) expired at %s: not run",
        envelope["id"],
        envelope["type"],
        expires.isoformat(),
    )
    return True
