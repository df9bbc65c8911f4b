"""CDC coexistence: what a change-data-capture reader (Debezium) sees of the
outbox table, read from PostgreSQL's WAL through logical decoding.

The outbox is "just a table": a CDC connector can stream its INSERTs to a
broker while the in-process relay fans events out, and neither sees the
other's work twice. What makes that true, shown here on the
decoded WAL (the built-in ``test_decoding`` plugin, the changes Debezium's
PostgreSQL connector reads with ``pgoutput``):

- every published event is one INSERT carrying every column; an action's
  sentinel is an INSERT with a NULL ``event_type`` (a connector filters it);
- with stream delivery, delivery, requeue and replay never write the outbox
  table again: an event row is written once and never updated;
- with row delivery, fan-out, delivery, requeue and replay write no INSERT and
  no DELETE on the outbox table, only one UPDATE per event that flips
  ``fanned_out`` (an outbox router ignores updates);
- purge's DELETEs are the only deletes, of the rows it purged.

Each test decodes through its own temporary replication slot (dropped at the
end, and by PostgreSQL if the test's connection dies), filtered to the outbox
table. Needs ``wal_level = logical`` (``.ci/run`` sets it).
"""

from __future__ import annotations

import datetime
import decimal
import re
import uuid
from dataclasses import dataclass

import pytest
from django.db import connection, transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, outbox_action, publish
from outbox_app.ops.purge import purge
from outbox_app.ops.subscriptions import replay_to
from outbox_app.relay import relay_once
from tests.testapp.events import OrderPlaced, Step

pytestmark = [
    pytest.mark.only_database("postgresql"),
    pytest.mark.django_db(transaction=True),  # decoding sees committed rows only
]

TABLE = OutboxEvent._meta.db_table
COLUMNS = {field.column for field in OutboxEvent._meta.concrete_fields}

#: One line of test_decoding: ``table public.t: INSERT: id[uuid]:'...' ...``.
_LINE = re.compile(r"table (?P<table>[^:]+): (?P<op>[A-Z]+):(?P<rest>.*)")
#: One column of a tuple: ``name[type]:value``, the value quoted ('' escapes a
#: quote) or bare (null, numbers, booleans); a name that is an SQL keyword
#: (``"position"``) in double quotes, as test_decoding quotes identifiers.
_COLUMN = re.compile(r"\"?(\w+)\"?\[[^\]]+\]:('(?:[^']|'')*'|\S+)")


@dataclass(frozen=True)
class Change:
    """One decoded change of the outbox table: the operation and its tuple
    (the new row for INSERT and UPDATE, the key for DELETE), each value as
    PostgreSQL's text output of the column (``None``: NULL)."""

    op: str
    row: dict[str, str | None]

    @property
    def id(self) -> uuid.UUID:
        return uuid.UUID(self.row["id"])

    def __str__(self) -> str:
        return f"{self.op} {self.row}"


def _value(text: str) -> str | None:
    if text.startswith("'"):
        return text[1:-1].replace("''", "'")
    return None if text == "null" else text


def _parse(line: str) -> tuple[str, Change] | None:
    match = _LINE.fullmatch(line)
    if match is None:  # BEGIN / COMMIT
        return None
    row = {name: _value(value) for name, value in _COLUMN.findall(match["rest"])}
    return match["table"], Change(match["op"], row)


class Slot:
    """A temporary logical replication slot on the test database, owned by a
    connection of its own (PostgreSQL drops the slot when it closes)."""

    def __init__(self) -> None:
        self.name = f"outbox_cdc_{uuid.uuid4().hex}"
        self.conn = connection.get_new_connection(connection.get_connection_params())
        self.conn.autocommit = True
        level = self._one("SHOW wal_level")
        if level != "logical":
            self.conn.close()
        if level != "logical":
            pytest.fail(
                f"PostgreSQL's wal_level is {level}: logical decoding needs "
                "ALTER SYSTEM SET wal_level = logical and a restart (.ci/run does)"
            )
        try:
            # Creating a slot waits for the transactions running on the whole
            # server to end: give up after a minute rather than hang.
            with self.conn.cursor() as cursor:
                cursor.execute("SET statement_timeout = '60s'")
            self._one(
                "SELECT slot_name FROM pg_create_logical_replication_slot"
                "(%s, 'test_decoding', true)",
                [self.name],
            )
        except BaseException:
            self.conn.close()  # a temporary slot goes with its connection
            raise

    def _one(self, sql: str, params=()):
        with self.conn.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchone()[0]

    def lines(self) -> list[str]:
        """Every decoded line since the last call (consumed)."""
        with self.conn.cursor() as cursor:
            cursor.execute(
                "SELECT data FROM pg_logical_slot_get_changes(%s, NULL, NULL, "
                "'include-xids', '0', 'skip-empty-xacts', '1')",
                [self.name],
            )
            return [data for (data,) in cursor.fetchall()]

    def changes(self) -> list[Change]:
        """The outbox table's changes since the last call, in commit order."""
        parsed = (_parse(line) for line in self.lines())
        return [
            change
            for found in parsed
            if found is not None
            for table, change in [found]
            if table.rsplit(".", 1)[-1] == TABLE
        ]

    def row_as_text(self, event_id: uuid.UUID) -> dict[str, str | None]:
        """The stored row, each column through the same text output as the
        decoded tuples (same session, so same time zone)."""
        names = sorted(COLUMNS)
        with self.conn.cursor() as cursor:
            cursor.execute(
                f"SELECT {', '.join(f'{name}::text' for name in names)} "
                f"FROM {TABLE} WHERE id = %s",
                [event_id],
            )
            return dict(zip(names, cursor.fetchone(), strict=True))

    def drop(self) -> None:
        try:
            self._one(
                "SELECT count(pg_drop_replication_slot(slot_name)) "
                "FROM pg_replication_slots WHERE slot_name = %s",
                [self.name],
            )
        finally:
            self.conn.close()


@pytest.fixture
def wal():
    """A replication slot decoding the test database's changes from now on."""
    slot = Slot()
    yield slot
    slot.drop()
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_name = %s",
            [slot.name],
        )
        assert cursor.fetchone()[0] == 0, f"slot {slot.name} left behind"


def publish_world() -> dict[str, OutboxEvent]:
    """Three subscribed events (two in one action), one of a type nobody
    subscribes to, and one action's sentinel."""
    rows = {}
    with transaction.atomic(), outbox_action("PlaceOrders", {"count": 2}):
        rows["a"], rows["b"] = publish(
            OrderPlaced(order_id=1, total=decimal.Decimal("9.50")),
            OrderPlaced(order_id=2, total=decimal.Decimal("1")),
            aggregate=("shop.Order", 1),
            headers={"correlation_id": "c-'1'"},
            tenant_id="t1",
        )
    with transaction.atomic():
        [rows["c"]] = publish(
            OrderPlaced(order_id=3, total=decimal.Decimal("3")),
            aggregate=("shop.Order", 3),
            aggregate_version=7,
        )
        [rows["unsubscribed"]] = publish(Step(position=1))
    with transaction.atomic(), outbox_action("NothingToSay", {"why": "empty cart"}):
        pass
    rows["sentinel"] = OutboxEvent.objects.sentinels().get()
    return rows


def by_op(changes: list[Change]) -> dict[str, list[Change]]:
    ops: dict[str, list[Change]] = {}
    for change in changes:
        ops.setdefault(change.op, []).append(change)
    return ops


def test_each_published_event_is_one_insert_with_every_column(wal):
    rows = publish_world()

    changes = wal.changes()

    assert {change.op for change in changes} == {"INSERT"}, changes
    assert sorted(change.id for change in changes) == sorted(
        row.id for row in rows.values()
    )
    for change in changes:
        # Every column, with the value the table holds.
        assert change.row == wal.row_as_text(change.id)
    inserted = {change.id: change.row for change in changes}
    a = inserted[rows["a"].id]
    assert (a["event_type"], a["aggregate_type"], a["aggregate_id"]) == (
        "OrderPlaced",
        "shop.Order",
        "1",
    )
    assert a["payload"] == '{"total": "9.50", "order_id": 1}'
    assert a["headers"] == '{"correlation_id": "c-\'1\'"}'
    assert a["action_name"] == "PlaceOrders"
    assert inserted[rows["c"].id]["aggregate_version"] == "7"
    # The sentinel is recognisable: an action and no event.
    sentinel = inserted[rows["sentinel"].id]
    assert sentinel["event_type"] is None and sentinel["payload"] is None
    assert sentinel["action_name"] == "NothingToSay"
    assert [row for row in inserted.values() if row["event_type"] is None] == [sentinel]


@pytest.mark.engine("stream")
def test_stream_delivery_requeue_replay_and_purge_write_no_event_row(wal, handlers):
    handlers("record")  # recorded first: their cursors start before the events
    handlers("broken")  # fails every time: FAILED, then requeued
    rows = publish_world()
    assert {change.op for change in wal.changes()} == {"INSERT"}

    relay_once()
    assert Delivery.objects.filter(subscriber="broken").dead_letter() == 3
    assert Delivery.objects.apply("requeue") == 3
    relay_once()  # the requeued deliveries fail again
    assert replay_to(OutboxEvent.objects.all(), "record_a").created == 3
    relay_once()  # the replayed ones succeed again
    assert wal.changes() == []

    Delivery.objects.all().delete()  # the rows that held their events back
    later = timezone.now() + datetime.timedelta(minutes=1)
    purge(0, pause_ratio=0, busy_pause_ratio=0, now=later)
    changes = wal.changes()
    assert {change.op for change in changes} == {"DELETE"}, changes
    assert {change.id for change in changes} == {row.id for row in rows.values()}


@pytest.mark.engine("rows")
def test_fan_out_delivery_requeue_and_replay_only_flip_fanned_out(wal, handlers):
    rows = publish_world()
    inserted = {change.id: change.row for change in wal.changes()}
    handlers("record")
    handlers("broken")  # fails every time: FAILED, then requeued

    relay_once()  # fan-out, then delivery to record_a, record_b and broken
    assert Delivery.objects.filter(subscriber="broken").dead_letter() == 3
    assert Delivery.objects.apply("requeue") == 3
    relay_once()  # the requeued deliveries fail again
    assert replay_to(OutboxEvent.objects.all(), "record_a").reset == 3
    relay_once()  # the replayed ones succeed again
    assert Delivery.objects.filter(subscriber="record_a").count() == 3

    changes = wal.changes()
    assert {change.op for change in changes} == {"UPDATE"}, changes
    fanned_out = {rows[key].id for key in ("a", "b", "c")}
    # One UPDATE per fanned-out event, however often it was delivered: the
    # same row with delivered flipped, nothing else changed.
    assert sorted(change.id for change in changes) == sorted(fanned_out)
    for change in changes:
        assert change.row == {**inserted[change.id], "fanned_out": "true"}
    # An event nobody subscribes to and the sentinel are not touched.
    assert not OutboxEvent.objects.filter(
        id__in=[rows["unsubscribed"].id, rows["sentinel"].id], fanned_out=True
    ).exists()


@pytest.mark.engine("rows")
def test_purge_deletes_are_the_only_deletes(wal, handlers):
    rows = publish_world()
    handlers("record")
    relay_once()
    before = by_op(wal.changes())
    assert set(before) == {"INSERT", "UPDATE"}

    later = timezone.now() + datetime.timedelta(minutes=1)
    counts = purge(0, pause_ratio=0, busy_pause_ratio=0, now=later)

    changes = wal.changes()
    assert {change.op for change in changes} == {"DELETE"}, changes
    purged = {rows[key].id for key in ("a", "b", "c", "sentinel")}
    assert sorted(change.id for change in changes) == sorted(purged)
    assert (counts.events, counts.sentinels) == (3, 1)
    # A DELETE carries the key only (replica identity DEFAULT).
    assert {tuple(change.row) for change in changes} == {("id",)}
    # The event nobody subscribes to is never fanned out, so never purged.
    assert list(OutboxEvent.objects.values_list("id", flat=True)) == [
        rows["unsubscribed"].id
    ]


def test_a_row_deleted_before_the_reader_gets_to_it_is_still_streamed(wal):
    """The slot keeps the WAL until it is read: deleting outbox rows (a purge,
    or an operator's clean-up of events only CDC consumes) never hides their
    INSERT from a connector, however far behind it is."""
    with transaction.atomic():
        [event] = publish(OrderPlaced(order_id=4, total=decimal.Decimal("4")))
    row = wal.row_as_text(event.id)
    OutboxEvent.objects.filter(id=event.id).delete()

    insert, delete = wal.changes()

    assert (insert.op, insert.id, insert.row) == ("INSERT", event.id, row)
    assert (delete.op, delete.id) == ("DELETE", event.id)


def test_the_documented_connector_sends_what_the_wal_carries(wal):
    """docs/cdc.md's connector places columns in headers by name: each is a
    column of the outbox table, and the INSERT of a tracked-style, acted,
    scheduled event carries the operation, who acted and the schedule."""
    import json

    from outbox_app import acting
    from tests.docs.blocks import ROOT, blocks

    [connector] = [
        json.loads(b.code)
        for b in blocks(ROOT / "docs" / "cdc.md")
        if b.tag == "json" and "connector.class" in b.code
    ]
    placement = connector["config"][
        "transforms.outbox.table.fields.additional.placement"
    ]
    placed = dict(item.split(":header:") for item in placement.split(","))
    columns = {f.column for f in OutboxEvent._meta.concrete_fields}
    assert set(placed) <= columns
    assert {"operation", "headers", "deliver_at", "expires_at"} <= set(placed)
    due = timezone.now() + datetime.timedelta(hours=1)
    with acting("7", path="/orders/"), transaction.atomic():
        [row] = publish(
            OrderPlaced(order_id=1, total=decimal.Decimal("1")),
            aggregate=("shop.Order", "1"),
            operation="create",
            deliver_at=due,
            expires_at=due + datetime.timedelta(hours=1),
        )
    [change] = wal.changes()
    assert change.row["operation"] == "create"
    assert json.loads(change.row["headers"]) == {
        "actor": "7",
        "metadata": {"path": "/orders/"},
    }
    assert change.row["deliver_at"] and change.row["expires_at"]
    assert change.row == wal.row_as_text(row.id)
