"""What operators see of stream delivery: for an event, each subscriber's
delivery (its row, or where its cursor stands), and each cursor's place
and lag.

A subscriber delivered an event by stream when its cursor has read past it
and no row of it is open; until then the event waits in the stream
(PENDING, as a row would be). Only what needs attention has a row: a failed
attempt, an event due later or waiting behind its aggregate, a requeue or a
replay (:mod:`outbox_app.relay.stream`).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from typing import Any

from django.db import connections, router

from ..store.clock import database_now
from ..store.gateway import Stream
from ..store.lifecycle import State
from ..store.models import Cursor, Delivery, OutboxEvent, Subscription
from ..store.sql import dialect
from ..subscribers import WILDCARD


def event_deliveries(event: OutboxEvent, using: str | None = None) -> dict[str, str]:
    """Each subscriber's delivery of ``event``, by subscriber name: the state
    of its delivery row where it has one; otherwise, for an event written
    for stream delivery, ``SUCCEEDED`` once the subscriber's cursor has read
    past it and ``PENDING`` before; for an event awaiting fan-out (row
    delivery), ``PENDING`` for each active subscription of its type. A
    subscriber whose cursor started after the event was published, or that
    does not take its type, is not listed.

    Args:
        event: an outbox event (a sentinel has no deliveries).
        using: database alias; default the event's.

    Returns:
        ``{subscriber: state}``, states as :class:`~outbox_app.store.
        lifecycle.State` values.
    """
    using = using or event._state.db or router.db_for_read(OutboxEvent)
    found = dict(
        Delivery.objects.using(using)
        .filter(event_id=event.pk)
        .values_list("subscriber", "state")
    )
    if event.event_type is None or event.fanned_out:
        return found
    takers, retired = _takers(event.event_type, using)
    if event.fanned_out is False:  # row delivery, awaiting fan-out
        return {**dict.fromkeys(takers - found.keys(), State.PENDING), **found}
    d = dialect(using)
    text = (
        f"SELECT c.subscriber, MAX(CASE WHEN {d.cursor_passed()} THEN 1 ELSE 0 "
        f"END) FROM {d.e} e JOIN {d.c} c ON {d.cursor_covers()} "
        "WHERE e.id = %s GROUP BY c.subscriber"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(text, [d.uuid_param(event.pk)])
        # A retired subscription's cursor delivered what it read; what it
        # had not read became rows when it was retired.
        streamed = {
            name: State.SUCCEEDED if passed else State.PENDING
            for name, passed in cursor.fetchall()
            if (name in takers or (name in retired and passed)) and name not in found
        }
    return {**streamed, **found}


def _takers(event_type: str, using: str) -> tuple[set[str], set[str]]:
    """The subscribers whose subscription to ``event_type`` (or to every
    type) is active, and those whose is retired."""
    active, retired = set(), set()
    for name, retired_at in (
        Subscription.objects.using(using)
        .filter(event_type__in=[event_type, WILDCARD])
        .values_list("subscriber", "retired_at")
    ):
        (active if retired_at is None else retired).add(name)
    return active, retired - active


def hand_over(
    subscriber: str,
    event_types: Iterable[str] | None,
    state: str,
    using: str = "default",
) -> int:
    """Write a delivery row in ``state`` (PENDING, due now: relays that have
    ``subscriber`` deliver it; or SKIPPED, given up) for every event of
    ``event_types`` (None: every type) written for stream delivery that
    ``subscriber``'s cursors are to deliver and have not read yet: its
    subscription to those types is being retired, so its cursors stop
    reading them (the lifecycle's ``hand_over``). An event with a row
    already keeps it. Returns rows written."""
    d = dialect(using)
    types = None if event_types is None else sorted(event_types)
    now = d.datetime_param(database_now(using))
    skipped = state == State.SKIPPED
    values = [
        subscriber,
        state,
        0,
        now,
        None,
        "",
        None,
        RETIRED_ERROR if skipped else "",
        "",
        "",
        None,
        now if skipped else None,
        now,
        now,
    ]
    text = d.divert_from(d.unread(None if types is None else len(types)))
    with connections[using].cursor() as cursor:
        cursor.execute(text, [*values, subscriber, *(types or [])])
        return cursor.rowcount


#: The error recorded on the rows of events a retired subscription gave up.
RETIRED_ERROR = "the subscription was retired before this event was delivered"


def restart(subscribers: Iterable[str], using: str = "default") -> int:
    """Move the cursors of ``subscribers`` to the current tick, as new
    cursors start: the events published before are no longer theirs (a
    subscriber reactivated after every subscription of it was retired does
    not receive what was published meanwhile, as fan-out did not create
    deliveries for it). A relay holding one loses its lease and takes it
    again. Returns cursors moved."""
    moved = 0
    tick, position = Stream(using).first_reading(False)
    for name in subscribers:
        moved += (
            Cursor.objects.using(using)
            .filter(subscriber=name)
            .update(
                tick=tick,
                next_tick=None,
                position=position or None,
                first_tick=tick,
                first_position=position,
                lease_token=None,
                locked_by="",
                locked_until=None,
                updated_at=database_now(using),
            )
        )
    return moved


def delivered(using: str = "default") -> dict[str, set]:
    """The events each subscriber is done with, by the subscriber's stored
    name: ``{subscriber: {event id, ...}}`` of its SUCCEEDED rows and the
    events its cursors delivered by stream (read past, no row). Reads every
    event kept: for reconciling a run, not for a page."""
    done: dict[str, set] = {}
    for event_id, subscriber in (
        Delivery.objects.using(using)
        .filter(state=State.SUCCEEDED)
        .values_list("event_id", "subscriber")
    ):
        done.setdefault(subscriber, set()).add(event_id)
    d = dialect(using)
    with connections[using].cursor() as cursor:
        cursor.execute(d.streamed, [])  # [] : "%%" is read as "%"
        for event_id, subscriber in cursor.fetchall():
            done.setdefault(subscriber, set()).add(d.uuid_value(event_id))
    return done


def waiting(using: str = "default") -> dict[tuple[str, str], int]:
    """How many events each subscriber's cursors have still to read, by
    ``(subscriber, event type)`` (of the types its active subscriptions
    take): the stream's share of what waits for it."""
    d = dialect(using)
    text = (
        f"SELECT c.subscriber, e.event_type, COUNT(*) FROM {d.e} e JOIN {d.c} c "
        f"ON {d.cursor_covers()} WHERE {d.streamed_event()} AND "
        f"{d.cursor_unread()} AND {d.cursor_takes()} "
        "GROUP BY c.subscriber, e.event_type"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(text, [])
        return {(name, kind): n for name, kind, n in cursor.fetchall()}


def awaited(using: str = "default") -> int:
    """How many events written for stream delivery some cursor has still to
    read (of a type its subscriber's active subscriptions take): the
    streams' backlog, whose rows do not exist."""
    d = dialect(using)
    text = (
        f"SELECT COUNT(*) FROM {d.e} e WHERE {d.streamed_event()} AND {d.awaited('e')}"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(text, [])  # [] : "%%" is read as "%"
        return cursor.fetchone()[0]


def lag(
    using: str = "default", now: datetime.datetime | None = None
) -> list[dict[str, Any]]:
    """Every cursor and how far behind it is: one dict each, by subscriber
    and partition::

        {"id": 3, "subscriber": "shop.email", "partition": 0, "partitions": 1,
         "waiting": 12,                  # events it has still to read
         "oldest_waiting_seconds": 3.2,  # since the oldest of them was
                                         # published; None: none waits
         "held_by": "host:123",          # the relay holding its lease, or ""
         "last_tick": "...",             # when it last read a tick to its end
         "last_tick_seconds": 0.4,
         "stopping": False}              # its partitions are changing

    Events count only where the subscriber's active subscriptions take their
    type. ``now`` defaults to the database's clock."""
    d = dialect(using)
    now = now or database_now(using)
    text = (
        f"SELECT c.id, COUNT(e.id), MIN(e.created_at) FROM {d.c} c LEFT JOIN "
        f"{d.e} e ON {d.streamed_event()} AND {d.cursor_covers()} AND "
        f"{d.cursor_unread()} AND {d.cursor_takes()} GROUP BY c.id"
    )
    with connections[using].cursor() as cursor:
        cursor.execute(text, [])
        counts = {
            row[0]: (row[1], d.datetime_value(row[2])) for row in cursor.fetchall()
        }
    found = []
    for cursor in Cursor.objects.using(using).order_by(
        "subscriber", "partitions", "partition"
    ):
        waiting, oldest = counts.get(cursor.id, (0, None))
        leased = (
            cursor.lease_token is not None
            and cursor.locked_until is not None
            and cursor.locked_until > now
        )
        found.append(
            {
                "id": cursor.id,
                "subscriber": cursor.subscriber,
                "partition": cursor.partition,
                "partitions": cursor.partitions,
                "waiting": waiting,
                "oldest_waiting_seconds": _seconds(now, oldest),
                "held_by": cursor.locked_by if leased else "",
                "last_tick": None
                if cursor.ticked_at is None
                else cursor.ticked_at.isoformat(),
                "last_tick_seconds": _seconds(now, cursor.ticked_at),
                "stopping": cursor.stop_tick is not None,
            }
        )
    return found


def _seconds(now: datetime.datetime, since: datetime.datetime | None) -> float | None:
    return None if since is None else max(0.0, (now - since).total_seconds())


def cursors(using: str = "default") -> list[Cursor]:
    """Every cursor, by subscriber and partition."""
    return list(Cursor.objects.using(using).order_by("subscriber", "partition"))
