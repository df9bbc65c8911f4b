"""What text outbox_app stores: the one rule for text stored unchanged
(:func:`unstorable`, :func:`require_storable`: an event's type, aggregate,
tenant, operation; a consumed CloudEvent's id, source, type, subject), and
text from outside made storable (:func:`storable`: error messages,
tracebacks, bodies, queue names)."""

from __future__ import annotations

from typing import Any

from ..exceptions import (
    InvalidEvent,
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


def storable(text: str | bytes) -> str:
    """``text`` as every supported database's text columns hold it, for text
    that comes from outside (an exception's message and traceback, a message
    body, a broker's queue name, a transport error): a lone surrogate, which
    no UTF-8 encoder takes, and an undecodable byte become backslash escapes
    (``\\udcff``, ``\\xff``); a NUL character, which PostgreSQL's text
    refuses, becomes ``\\x00``. Any other text is returned unchanged.
    Every such text outbox_app stores passes through here first."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "backslashreplace")
    else:
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text.replace("\x00", "\\x00")
