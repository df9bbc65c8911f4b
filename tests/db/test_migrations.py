"""The migration set matches the models, on every database."""

from io import StringIO

import pytest
from django.core.management import call_command
from django.db import connection, transaction

from outbox_app import publish


@pytest.mark.django_db
def test_makemigrations_check__no_changes():
    out = StringIO()
    call_command("makemigrations", "--check", "--dry-run", stdout=out, stderr=out)


@pytest.mark.django_db
def test_indexes_fit_the_database():
    with connection.cursor() as cursor:
        due = connection.introspection.get_constraints(
            cursor, "outbox_app_notification"
        )["outbox_notification_due"]
        undelivered = connection.introspection.get_constraints(
            cursor, "outbox_app_outboxevent"
        )["outbox_event_undelivered"]
    # In the order claims and fan-out read them, so a batch reads only the
    # index entries it takes (migration 0002).
    if connection.features.supports_partial_indexes:
        assert due["columns"] == ["subscriber", "next_retry_at", "id"]
        assert undelivered["columns"] == ["id", "event_type"]
    else:
        # Django drops conditions on MySQL/MariaDB: a composite index instead.
        assert due["columns"] == ["state", "subscriber", "next_retry_at", "id"]
        assert undelivered["columns"] == ["delivered", "id", "event_type"]


@pytest.mark.django_db(transaction=True)
def test_positions_and_sizes_are_filled_in_id_order_for_existing_rows():
    """Migration 0010 on a table with events: they are numbered in id order
    (the order ordered subscribers followed for unversioned events), their
    payload sizes measured, both copied onto their notifications; an event
    inserted afterwards gets the next position."""
    import datetime
    import uuid

    from django.db.migrations.executor import MigrationExecutor

    before, after = (
        ("outbox_app", "0009_inbox_source_and_consumers"),
        ("outbox_app", "0010_event_position_and_size"),
    )
    executor = MigrationExecutor(connection)
    executor.migrate([before])
    try:
        old = executor.loader.project_state([before]).apps
        events = old.get_model("outbox_app", "OutboxEvent")
        deliveries = old.get_model("outbox_app", "Notification")
        now = datetime.datetime.now(datetime.UTC)
        ids = [uuid.UUID(int=n) for n in (3, 1, 2)]  # inserted out of id order
        for n, event_id in enumerate(ids):
            event = events.objects.create(
                id=event_id,
                namespace="test",
                event_type="Step",
                payload={"position": "x" * n},
                occurred_at=now,
                delivered=True,
            )
            deliveries.objects.create(
                event=event, subscriber="s", event_type="Step", next_retry_at=now
            )
    finally:
        executor = MigrationExecutor(connection)
        executor.migrate([after])
    from outbox_app.models import Notification, OutboxEvent

    rows = OutboxEvent.objects.order_by("position")
    assert [r.id for r in rows] == sorted(ids)
    assert [r.position for r in rows] == [1, 2, 3]
    # {"position": ""} with 0, 1, 2 x's, as the database stores the JSON.
    sizes = {r.id: r.payload_bytes for r in rows}
    assert sizes[ids[0]] == len(b'{"position": ""}')
    assert sizes[ids[2]] == sizes[ids[0]] + 2
    for note in Notification.objects.all():
        event = OutboxEvent.objects.get(id=note.event_id)
        assert (note.position, note.payload_bytes) == (
            event.position,
            event.payload_bytes,
        )
    with transaction.atomic():
        (new,) = publish({"event_type": "Step", "payload": {}})
    assert OutboxEvent.objects.get(id=new.id).position == 4
