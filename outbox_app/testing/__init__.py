"""Testing with the outbox in your own test suite (docs/testing.md).

* :func:`capture_events`: what a block of code published, in Django's
  ``TestCase`` (whose transaction never commits) as in a
  ``TransactionTestCase``, with assertions (``assert_published(OrderPlaced,
  order_id=1)``) and the events as the relay would read them;
* :meth:`CapturedEvents.deliver_now`: the in-process handlers of the
  captured events, run now, in the test, as the relay runs them, failures
  included;
* :class:`RecordingPublisher` and :func:`record_publishers`: a publisher that
  records what it would send;
* :mod:`outbox_app.testing.pytest`: the same as pytest fixtures
  (``pytest_plugins = ["outbox_app.testing.pytest"]``).

The names below are loaded on first access, so importing this package (the
pytest plugin does, before Django is set up) loads no model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .capture import CapturedEvent, CapturedEvents, capture_events
    from .delivery import DeliveryOutcome, DeliveryReport
    from .publisher import (
        RecordingPublisher,
        SentMessage,
        SentMessages,
        record_publishers,
    )

__all__ = [
    "CapturedEvent",
    "CapturedEvents",
    "DeliveryOutcome",
    "DeliveryReport",
    "RecordingPublisher",
    "SentMessage",
    "SentMessages",
    "capture_events",
    "record_publishers",
]

_LAZY = {
    "CapturedEvent": "capture",
    "CapturedEvents": "capture",
    "capture_events": "capture",
    "DeliveryOutcome": "delivery",
    "DeliveryReport": "delivery",
    "RecordingPublisher": "publisher",
    "SentMessage": "publisher",
    "SentMessages": "publisher",
    "record_publishers": "publisher",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    return getattr(import_module(f".{module}", __name__), name)
