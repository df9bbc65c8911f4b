"""What a block of code published: :func:`capture_events`, the
:class:`CapturedEvents` it yields (the assertions of
:class:`~outbox_app.testing.recording.Recording`), and ``deliver_now()``,
which runs their handlers as the relay would
(:mod:`outbox_app.testing.delivery`)."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from contextlib import contextmanager

from .delivery import DeliveryReport, deliver_now
from .recording import CapturedEvent, Recording

__all__ = ["CapturedEvent", "CapturedEvents", "capture_events"]


class CapturedEvents(Recording):
    """The events published while a :func:`capture_events` block (or the
    ``outbox`` pytest fixture) was on, in publish order, and assertions on
    them.

    Every property reads the captured rows back from their databases (one
    query per database), so it answers for the moment it is read: an event
    captured inside a savepoint that rolls back afterwards moves from
    :attr:`events` to :attr:`rolled_back`.
    """

    def deliver_now(
        self, *, at: datetime.datetime | None = None, raise_errors: bool = True
    ) -> DeliveryReport:
        """Run the in-process handlers of the captured events now, as the
        relay would: :func:`outbox_app.testing.delivery.deliver_now`, which
        documents the arguments, the report and the errors."""
        return deliver_now(self, at=at, raise_errors=raise_errors)


@contextmanager
def capture_events() -> Iterator[CapturedEvents]:
    """Capture what the block publishes, in this process (every thread)::

        with capture_events() as outbox:
            place_order(...)
        outbox.assert_published(OrderPlaced, order_id=1)
        outbox.deliver_now()

    Works inside Django's ``TestCase`` (whose transaction never commits:
    :attr:`CapturedEvents.events` are those that would commit) as in a
    ``TransactionTestCase`` (where they did). The captured events stay
    readable after the block.

    Yields:
        The :class:`CapturedEvents`.
    """
    captured = CapturedEvents()
    with captured.listening():
        yield captured
