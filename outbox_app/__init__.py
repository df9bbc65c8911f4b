"""outbox_app: the transactional outbox for Django.

Publish events in the same database transaction as your ORM writes; a relay
delivers them afterwards, at least once, to brokers and in-process handlers.

The public API is importable from here, each name loaded on first access.
Only the three models need Django's app registry: every other name imports
before ``django.setup()`` (a settings file, a ``celery.py``, an
``events.py``), as Celery's ``shared_task`` does, and is the same object
afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .events.types import Event, upcaster
from .exceptions import InvalidEvent, OutboxError

if TYPE_CHECKING:
    from .inbox.registry import ConsumeContext, consumer
    from .publishing.aggregates import RecordsEvents, translator
    from .publishing.enqueue import enqueue
    from .publishing.outbox import acting, events_committed, outbox_action, publish
    from .publishing.tracking import track, untracked
    from .relay.registry import handler
    from .store.models import Delivery, InboxMessage, OutboxEvent
    from .subscribers import DeliveryContext

#: What an application imports: events and publishing, handlers and consumers,
#: the models it may query, and the two errors it may catch around publish().
#: Every other exception is in :mod:`outbox_app.exceptions`; the relay,
#: inbox and operations are reachable by module (``outbox_app.relay``, ...).
__all__ = [
    "ConsumeContext",
    "Delivery",
    "DeliveryContext",
    "Event",
    "InboxMessage",
    "InvalidEvent",
    "OutboxError",
    "OutboxEvent",
    "RecordsEvents",
    "acting",
    "consumer",
    "enqueue",
    "events_committed",
    "handler",
    "outbox_action",
    "publish",
    "track",
    "translator",
    "untracked",
    "upcaster",
]

_LAZY = {
    "publish": "publishing.outbox",
    "outbox_action": "publishing.outbox",
    "events_committed": "publishing.outbox",
    "acting": "publishing.outbox",
    "enqueue": "publishing.enqueue",
    "track": "publishing.tracking",
    "RecordsEvents": "publishing.aggregates",
    "translator": "publishing.aggregates",
    "untracked": "publishing.tracking",
    "OutboxEvent": "models",
    "Delivery": "models",
    "handler": "relay.registry",
    "consumer": "inbox.registry",
    "ConsumeContext": "inbox.registry",
    "InboxMessage": "models",
    "DeliveryContext": "subscribers",
}


def __getattr__(name: str) -> Any:
    from importlib import import_module

    module = _LAZY.get(name)
    if module is not None:
        return getattr(import_module(f".{module}", __name__), name)
    # The exceptions were importable from here before they had their module;
    # they still are, outside __all__.
    exceptions = import_module(".exceptions", __name__)
    if isinstance(getattr(exceptions, name, None), type):
        return getattr(exceptions, name)
    raise AttributeError(f"module 'outbox_app' has no attribute {name!r}")
