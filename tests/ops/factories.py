"""Rows for the operations tests, written with the ORM: no relay involved."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, handler, publish
from outbox_app.relay.registry import unregister
from outbox_app.store.lifecycle import State


def events(
    n: int = 1, event_type: str = "OrderPlaced", payload=None, **publish_kwargs
) -> list[OutboxEvent]:
    """``n`` committed outbox events of one type (``fanned_out`` False)."""
    with transaction.atomic():
        return publish(
            *[
                {"event_type": event_type, "payload": payload or {"n": i}}
                for i in range(n)
            ],
            **publish_kwargs,
        )


def delivery(
    event: OutboxEvent,
    subscriber: str = "ops.record",
    state: State = State.PENDING,
    *,
    age: datetime.timedelta = datetime.timedelta(0),
    **fields,
) -> Delivery:
    """One delivery of ``event``; finished states get plausible outcome fields.
    ``age`` moves every timestamp that far into the past."""
    now = timezone.now() - age
    values = {
        "event_type": event.event_type,
        "aggregate_type": event.aggregate_type,
        "aggregate_id": event.aggregate_id,
        "aggregate_version": event.aggregate_version,
        "tenant_id": event.tenant_id,
        "state": state,
        "next_retry_at": now,
        "created_at": now,
        "updated_at": now,
    }
    if state in (State.FAILED, State.DEAD):
        values.update(
            attempts=3,
            last_error="broker down",
            last_error_type="builtins.ConnectionError",
            last_traceback="Traceback (most recent call last):\nConnectionError",
            first_failed_at=now,
        )
    if state == State.FAILED:
        values["next_retry_at"] = now + datetime.timedelta(hours=1)
    if state in (State.SUCCEEDED, State.DEAD):
        values["completed_at"] = now
        values.setdefault("attempts", 1)
    if state == State.RUNNING:
        values.update(attempts=1, locked_until=now + datetime.timedelta(minutes=1))
    values.update(fields)
    return Delivery.objects.create(event=event, subscriber=subscriber, **values)


def mark_delivered(*rows: OutboxEvent) -> None:
    OutboxEvent.objects.filter(pk__in=[r.pk for r in rows]).update(fanned_out=True)


def age_events(rows, age: datetime.timedelta) -> None:
    OutboxEvent.objects.filter(pk__in=[r.pk for r in rows]).update(
        created_at=timezone.now() - age, occurred_at=timezone.now() - age
    )


@contextmanager
def subscribed(
    *event_types: str, name: str = "ops.record", **options
) -> Iterator[Callable]:
    """A registered handler for the duration of the block."""

    def fn(event, context):
        return None

    handler(*event_types, name=name, **options)(fn)
    try:
        yield fn
    finally:
        unregister(name)
