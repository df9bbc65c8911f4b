"""Helpers the tests share: what an operator sees of deliveries, whichever
engine delivered them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from outbox_app import OutboxEvent
from outbox_app.ops.streams import event_deliveries


def deliveries(
    events: Iterable[OutboxEvent] | None = None, using: str = "default"
) -> dict[tuple, str]:
    """``{(event id, subscriber): state}`` of every delivery of ``events``
    (default: every event) as an operator sees it: its row's state, or, by
    stream, SUCCEEDED once the subscriber's cursor passed it and PENDING
    before."""
    chosen = (
        OutboxEvent.objects.using(using).exclude(event_type=None)
        if events is None
        else events
    )
    return {
        (event.id, subscriber): state
        for event in chosen
        for subscriber, state in event_deliveries(event, using).items()
    }


def states(
    subscriber: str | None = None,
    events: Iterable[OutboxEvent] | None = None,
    using: str = "default",
) -> Counter:
    """How many deliveries (of ``subscriber``, of ``events``) are in each
    state."""
    return Counter(
        state
        for (_, name), state in deliveries(events, using).items()
        if subscriber is None or name == subscriber
    )


def outcome_writes(captured_queries) -> int:
    """How many statements of ``captured_queries`` (Django's
    ``CaptureQueriesContext``) wrote deliveries' outcomes: a row engine's
    SUCCEEDED marks, or a stream cursor's moves."""
    return sum(
        q["sql"].startswith("UPDATE")
        and (
            "SUCCEEDED" in q["sql"]
            # A cursor's move, not its lease taken or handed back.
            or ("SET tick" in q["sql"] and "lease_token = NULL" not in q["sql"])
        )
        for q in captured_queries
    )


def taken() -> bool:
    """Whether a relay has taken deliveries it has not recorded yet: a
    RUNNING row, or a cursor under a lease."""
    from outbox_app import Delivery
    from outbox_app.store.lifecycle import State
    from outbox_app.store.models import Cursor

    return (
        Delivery.objects.filter(state=State.RUNNING).exists()
        or Cursor.objects.exclude(lease_token=None).exists()
    )


def succeeded(using: str = "default") -> int:
    """How many deliveries are done, whichever engine delivered them (see
    :func:`succeeded_ids`)."""
    return sum(succeeded_ids(using).values())


def succeeded_ids(using: str = "default") -> Counter:
    """The events delivered, counted once per subscriber that is done with
    them (SUCCEEDED rows, and events a cursor delivered by stream)."""
    from outbox_app.ops.streams import delivered

    return Counter(i for ids in delivered(using).values() for i in ids)
