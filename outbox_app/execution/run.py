"""What user code receives and what its failure leaves: the event a handler
or a consumer is called with, and an exception as a failed row records it."""

from __future__ import annotations

import traceback
from typing import Any

from ..conf import outbox_settings
from ..events.codec import decode
from ..events.text import storable
from ..events.types import event_class
from ..subscribers import DeliveryContext, dotted_path


def event_for(context: DeliveryContext) -> Any:
    """The event a handler receives: the Event instance, or the payload dict for
    a type no class defines.

    Raises:
        EventDecodeError: the payload no longer fits its class.
    """
    if event_class(context.event_type) is None:
        return context.payload
    return decode(context.event_type, context.revision, context.payload)


def recorded_error(error: BaseException) -> tuple[str, str, str]:
    """``(message, dotted type, traceback)`` of ``error`` as failed rows keep
    them (deliveries, inbox messages): the traceback's last
    ``OUTBOX_TRACEBACK_MAX_CHARS`` characters; each made storable
    (:func:`~outbox_app.events.text.storable`: a lone surrogate or a NUL character in
    an exception's text becomes a backslash escape). An exception whose
    ``str()`` raises is recorded by its type."""
    limit = outbox_settings.TRACEBACK_MAX_CHARS
    text = "".join(traceback.format_exception(error))
    try:
        message = str(error) or repr(error)
    except Exception:
        message = f"<{type(error).__name__}: str() raised>"
    return (
        storable(message),
        storable(dotted_path(type(error)))[:255],
        storable(text[-limit:] if limit else ""),
    )
