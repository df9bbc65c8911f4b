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
        due = connection.introspection.get_constraints(cursor, "outbox_app_delivery")[
            "outbox_delivery_due"
        ]
        awaiting = connection.introspection.get_constraints(
            cursor, "outbox_app_outboxevent"
        )["outbox_event_fanout"]
    # In the order claims and fan-out read them, so a batch reads only the
    # index entries it takes (migration 0002).
    if connection.features.supports_partial_indexes:
        assert due["columns"] == ["subscriber", "next_retry_at", "id"]
        assert awaiting["columns"] == ["id", "event_type"]
    else:
        # Django drops conditions on MySQL/MariaDB: a composite index instead.
        assert due["columns"] == ["state", "subscriber", "next_retry_at", "id"]
        assert awaiting["columns"] == ["fanned_out", "id", "event_type"]


@pytest.mark.django_db(transaction=True)
def test_positions_and_sizes_are_filled_in_id_order_for_existing_rows():
    """Migration 0010 on a table with events: they are numbered in id order
    (the order ordered subscribers followed for unversioned events), their
    payload sizes measured, both copied onto their deliveries; an event
    inserted afterwards gets the next position."""
    import datetime
    import uuid

    from django.db.migrations.executor import MigrationExecutor

    before = ("outbox_app", "0009_inbox_source_and_consumers")
    executor = MigrationExecutor(connection)
    after = executor.loader.graph.leaf_nodes("outbox_app")
    executor.migrate([before])
    try:
        old = executor.loader.project_state([before]).apps
        events = old.get_model("outbox_app", "OutboxEvent")
        deliveries = old.get_model("outbox_app", "Notification")  # its name then
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
        executor.migrate(after)
    from outbox_app.models import Delivery, OutboxEvent

    rows = OutboxEvent.objects.order_by("position")
    assert [r.id for r in rows] == sorted(ids)
    assert [r.position for r in rows] == [1, 2, 3]
    # {"position": ""} with 0, 1, 2 x's, as the database stores the JSON.
    sizes = {r.id: r.payload_bytes for r in rows}
    assert sizes[ids[0]] == len(b'{"position": ""}')
    assert sizes[ids[2]] == sizes[ids[0]] + 2
    for note in Delivery.objects.all():
        event = OutboxEvent.objects.get(id=note.event_id)
        assert (note.position, note.payload_bytes) == (
            event.position,
            event.payload_bytes,
        )
    with transaction.atomic():
        (new,) = publish({"event_type": "Step", "payload": {}})
    assert OutboxEvent.objects.get(id=new.id).position == 4


@pytest.mark.django_db(transaction=True)
def test_the_renames_keep_rows_grants_and_indexes():
    """Migration 0011 (Notification -> Delivery, delivered -> fanned_out),
    run by ``migrate`` backwards and forwards over stored rows: every row and
    value stays, a group granted ``requeue_notification`` holds
    ``requeue_delivery``, and the renamed unique constraint still refuses a
    second delivery of one event to one subscriber."""
    import datetime
    import uuid

    from django.contrib.auth.models import Group, Permission
    from django.db import IntegrityError

    from outbox_app.models import Delivery, OutboxEvent

    now = datetime.datetime.now(datetime.UTC)
    event = OutboxEvent.objects.create(
        id=uuid.UUID(int=7),
        namespace="test",
        event_type="Step",
        payload={},
        occurred_at=now,
        fanned_out=True,
    )
    waiting = OutboxEvent.objects.create(
        id=uuid.UUID(int=8),
        namespace="test",
        event_type="Step",
        payload={},
        occurred_at=now,
        fanned_out=False,
    )
    row = Delivery.objects.create(
        event=event, subscriber="s", event_type="Step", next_retry_at=now, attempts=3
    )
    operators = Group.objects.create(name="operators")
    operators.permissions.add(Permission.objects.get(codename="requeue_delivery"))

    out = StringIO()
    call_command("migrate", "outbox_app", "0010", stdout=out)
    with connection.cursor() as cursor:
        tables = connection.introspection.table_names(cursor)
    assert "outbox_app_notification" in tables and "outbox_app_delivery" not in tables
    assert operators.permissions.get().codename == "requeue_notification"
    call_command("migrate", "outbox_app", stdout=out)

    assert operators.permissions.get().codename == "requeue_delivery"
    kept = Delivery.objects.get()
    assert (kept.id, kept.event_id, kept.attempts) == (row.id, event.id, 3)
    assert list(OutboxEvent.objects.awaiting_fanout()) == [waiting]
    with connection.cursor() as cursor:
        names = connection.introspection.get_constraints(cursor, "outbox_app_delivery")
    assert {"outbox_delivery_uniq", "outbox_delivery_due"} <= set(names)
    with pytest.raises(IntegrityError), transaction.atomic():
        Delivery.objects.create(
            event=event, subscriber="s", event_type="Step", next_retry_at=now
        )


@pytest.mark.django_db(transaction=True)
def test_the_dead_letter_is_one_state_backwards_and_forwards():
    """Migration 0012 converts the stored states in place: a delivery out of
    attempts was EXPIRED and an inbox message out of attempts PARKED; both
    are DEAD, and an ordered subscriber's DEAD row still holds back its
    aggregate (the rebuilt index's condition lists DEAD)."""
    import datetime
    import uuid

    from outbox_app.models import Delivery, InboxMessage, OutboxEvent
    from outbox_app.store.lifecycle import InboxState, State

    now = datetime.datetime.now(datetime.UTC)
    event = OutboxEvent.objects.create(
        id=uuid.UUID(int=9),
        namespace="test",
        event_type="Step",
        payload={},
        occurred_at=now,
        aggregate_type="Order",
        aggregate_id="1",
        fanned_out=True,
    )
    dead = Delivery.objects.create(
        event=event,
        subscriber="s",
        event_type="Step",
        aggregate_type="Order",
        aggregate_id="1",
        next_retry_at=now,
        state=State.DEAD,
    )
    message = InboxMessage.objects.create(
        consumer="c", message_id="m", state=InboxState.DEAD, attempts=5
    )

    def stored(model, pk):
        with connection.cursor() as cursor:
            table = connection.ops.quote_name(model._meta.db_table)
            cursor.execute(f"SELECT state FROM {table} WHERE id = %s", [pk])
            return cursor.fetchone()[0]

    out = StringIO()
    call_command("migrate", "outbox_app", "0011", stdout=out)
    assert (stored(Delivery, dead.pk), stored(InboxMessage, message.pk)) == (
        "EXPIRED",
        "PARKED",
    )
    call_command("migrate", "outbox_app", stdout=out)
    assert (stored(Delivery, dead.pk), stored(InboxMessage, message.pk)) == (
        "DEAD",
        "DEAD",
    )
    assert Delivery.objects.for_subscribers(["s"]).blocked_aggregates() == 1
