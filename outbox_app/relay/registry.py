"""Which subscribers this process has: in-process handlers (``@handler``) and
broker publishers (``OUTBOX_PUBLISHERS``).

A subscriber's ``name`` is the stable key stored on its deliveries. A handler's
defaults to the function's dotted path; ``aliases`` keeps rows stored under an
old name flowing after a rename. A publisher's name is its ``OUTBOX_PUBLISHERS``
key. The subscriber classes themselves are in :mod:`outbox_app.subscribers`.
"""

from __future__ import annotations

import difflib
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured

from ..conf import outbox_settings
from ..events.types import Event, validate_event_type
from ..exceptions import UnknownSubscriber
from ..publishers.base import Publisher, build_publisher
from ..subscribers import (
    Handler,
    Kind,
    Subscriber,
    check_stream_options,
    dotted_path,
    keep,
    registry_lock,
)

_handlers: dict[str, Handler] = {}


def handler(
    *event_types: type[Event] | str,
    name: str | None = None,
    max_attempts: int | None = None,
    retry_on: Sequence[type[BaseException]] = (Exception,),
    give_up_on: Sequence[type[BaseException]] = (),
    ordered: bool = False,
    timeout: float | None = None,
    aliases: Iterable[str] = (),
    start: str = "now",
    partitions: int | None = None,
) -> Callable[[Callable], Callable]:
    """Register ``fn(event, context)`` as an in-process handler.

    Put handlers in a ``handlers.py`` module of an installed app: outbox_app
    imports every app's ``handlers`` module at start-up, as the admin does with
    ``admin.py``.

    Args:
        *event_types: Event classes or type names the handler receives.
        name, max_attempts, retry_on, give_up_on, ordered, timeout: a
            consumer's options too, documented once on
            :class:`~outbox_app.subscribers.Callee`: the stable key stored on
            its deliveries (default: the function's dotted path), attempts
            before the delivery is DEAD (default ``OUTBOX_MAX_ATTEMPTS``),
            exception classes retried with backoff / dead-lettered at once
            (checked first), per-aggregate publish order, seconds one
            attempt may run (None: no limit).
        aliases, start, partitions: a publisher's options too, documented
            on :class:`~outbox_app.subscribers.Subscriber`: former names
            whose deliveries keep flowing to it, where a new handler's
            stream cursor starts (``"now"`` or ``"earliest"``), how many
            partitions its events are split into (default
            ``OUTBOX_PARTITIONS``).

    Returns:
        The decorator; it returns ``fn`` unchanged.

    Raises:
        ImproperlyConfigured: no event type, or a name already taken by another
            function.
        InvalidEventType: a malformed type name.
    """
    if not event_types:
        raise ImproperlyConfigured("@handler needs at least one event class or type")
    check_stream_options("@handler", start, partitions)
    types = frozenset(
        validate_event_type(t if isinstance(t, str) else t.event_type)
        for t in event_types
    )

    def register(fn: Callable) -> Callable:
        key = name or dotted_path(fn)
        spec = Handler(
            name=key,
            event_types=types,
            ordered=ordered,
            max_attempts=max_attempts,
            aliases=tuple(aliases),
            fn=fn,
            retry_on=tuple(retry_on),
            give_up_on=tuple(give_up_on),
            timeout=timeout,
            start=start,
            partitions=partitions,
        )
        keep(_handlers, spec, "handler")
        _changed()
        return fn

    return register


def unregister(name: str) -> None:
    """Remove a handler (tests and late-subscriber scenarios)."""
    with registry_lock:
        _handlers.pop(name, None)
    _changed()


#: Bumped whenever a handler is registered or removed (:func:`version`).
_handlers_version = 0


def _changed() -> None:
    global _handlers_version
    with registry_lock:
        _handlers_version += 1


def version() -> tuple:
    """A value that changes whenever the subscribers this process has may
    have: a handler registered or removed, ``OUTBOX_PUBLISHERS`` set anew
    (a test's ``override_settings``), publishers closed. Cheap: no
    publisher is built."""
    return (_handlers_version, _generation, id(outbox_settings.raw("PUBLISHERS")))


def handlers() -> list[Handler]:
    """Every registered handler."""
    with registry_lock:
        return list(_handlers.values())


#: Publishers built by each thread (a greenlet under gevent's patched
#: ``threading.local``): a publisher holds a broker connection and the confirm
#: state of its batches, which one thread at a time may use, so relays running
#: side by side in one process (Celery's thread and gevent pools) never share
#: one.
_local = threading.local()
#: Every publisher built, whichever thread built it, for close_publishers().
_built: list[Publisher] = []
#: Bumped by close_publishers(): a thread's cache of an older generation is
#: dropped, so no thread reuses a closed publisher.
_generation = 0


def publishers() -> list[Publisher]:
    """This thread's publisher for each ``OUTBOX_PUBLISHERS`` entry, built on
    first use.

    Raises:
        ImproperlyConfigured: an entry's ``BACKEND`` cannot be imported or
            rejects its options.
    """
    configured: Mapping[str, Mapping[str, Any]] = outbox_settings.PUBLISHERS
    if getattr(_local, "generation", None) != _generation:
        _local.publishers, _local.generation = {}, _generation
    cache: dict[tuple[str, str], Publisher] = _local.publishers
    result = []
    for key, options in configured.items():
        cache_key = (key, repr(sorted(options.items())))
        publisher = cache.get(cache_key)
        if publisher is None:
            publisher = cache[cache_key] = build_publisher(key, options)
            with registry_lock:
                _built.append(publisher)
        result.append(publisher)
    return result


def close_publishers() -> None:
    """Close every publisher built so far, in every thread, and forget them (a
    relay shutting down; tests changing ``OUTBOX_PUBLISHERS``)."""
    global _generation
    with registry_lock:
        built = list(_built)
        _built.clear()
        _generation += 1
    for publisher in built:
        publisher.close()


def subscribers(kind: Kind | None = None) -> list[Subscriber]:
    """Every subscriber, or only handlers / only publishers."""
    found: list[Subscriber] = []
    if kind in (None, "handler"):
        found.extend(handlers())
    if kind in (None, "publisher"):
        found.extend(publishers())
    return found


def get(name: str) -> Subscriber:
    """The subscriber stored under ``name`` (its own name or an alias).

    Raises:
        UnknownSubscriber: no handler or publisher has that name; the message
            lists the names there are, the closest first.
    """
    known = subscribers()
    for subscriber in known:
        if name in subscriber.stored_names:
            return subscriber
    names = sorted(n for s in known for n in s.stored_names)
    close = difflib.get_close_matches(name, names, n=3)
    listed = ", ".join(close + [n for n in names if n not in close]) or "none"
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise UnknownSubscriber(
        f"no handler or publisher is named {name!r}{hint}; known: {listed}"
    )
