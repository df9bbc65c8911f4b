"""publish(): rows commit with the caller's transaction, or not at all."""

from __future__ import annotations

import datetime
import decimal
import uuid

import pytest
from django.db import IntegrityError, connection, transaction
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from outbox_app import (
    DuplicateAggregateVersion,
    DuplicateOutboxEvent,
    InvalidEvent,
    InvalidEventType,
    InvalidPayload,
    OutboxEvent,
    OutboxRequiresActiveTransaction,
    PayloadTooLarge,
    outbox_action,
    publish,
)
from outbox_app.events.codec import decode
from outbox_app.store.gateway import streaming
from tests.testapp.events import Address, OrderPlaced, OrderShipped
from tests.testapp.models import Order

pytestmark = pytest.mark.django_db(transaction=True)


def placed(order: Order) -> OrderPlaced:
    return OrderPlaced(order_id=order.pk, total=order.total)


def test_publish__commits_with_the_callers_writes(wakeups):
    with transaction.atomic():
        order = Order.objects.create(reference="A-1", total=decimal.Decimal("9.99"))
        [row] = publish(placed(order), aggregate=order)
        assert wakeups == []  # nothing before the commit
    stored = OutboxEvent.objects.get()
    assert stored.id == row.id and stored.id.version == 7
    assert (stored.event_type, stored.revision) == ("OrderPlaced", 1)
    assert (stored.aggregate_type, stored.aggregate_id) == (
        "testapp.Order",
        str(order.pk),
    )
    assert stored.payload == {"order_id": order.pk, "total": "9.99"}
    assert stored.namespace == "tests"
    # Row delivery fans it out (False until then); stream delivery never
    # writes it again (NULL).
    assert stored.fanned_out is (None if streaming() else False)
    assert wakeups == ["default"]


def test_publish__rollback_leaves_no_row_and_no_wakeup(wakeups):
    with pytest.raises(RuntimeError), transaction.atomic():
        order = Order.objects.create(reference="A-2")
        publish(placed(order), aggregate=order)
        raise RuntimeError("boom")
    assert not Order.objects.exists()
    assert not OutboxEvent.objects.exists()
    assert wakeups == []


def test_publish__savepoint_rollback_inside_committed_transaction(wakeups):
    with transaction.atomic():
        kept = Order.objects.create(reference="kept")
        publish(placed(kept), aggregate=kept)
        try:
            with transaction.atomic():
                lost = Order.objects.create(reference="lost")
                publish(placed(lost), aggregate=lost)
                raise RuntimeError("inner failure")
        except RuntimeError:
            pass
    assert list(OutboxEvent.objects.values_list("aggregate_id", flat=True)) == [
        str(kept.pk)
    ]
    assert wakeups == ["default"]


def test_publish__only_in_rolled_back_savepoint_gives_no_wakeup(wakeups):
    with transaction.atomic():
        Order.objects.create(reference="no events")
        try:
            with transaction.atomic():
                publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
                raise RuntimeError("inner failure")
        except RuntimeError:
            pass
    assert not OutboxEvent.objects.exists()
    assert wakeups == []


def test_publish__several_calls_one_wakeup_per_transaction(wakeups):
    with transaction.atomic():
        for i in range(3):
            publish(OrderPlaced(order_id=i, total=decimal.Decimal(i)))
    assert OutboxEvent.objects.count() == 3
    assert wakeups == ["default"]


def test_publish__outside_transaction_raises_and_writes_nothing(wakeups):
    with pytest.raises(OutboxRequiresActiveTransaction, match="transaction.atomic"):
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
    assert not OutboxEvent.objects.exists()
    assert wakeups == []


def test_publish__one_insert_per_call():
    events = [OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(5)]
    with transaction.atomic(), CaptureQueriesContext(connection) as queries:
        rows = publish(*events, aggregate=("shop.Order", "42"), aggregate_version=1)
    inserts = [
        q["sql"] for q in queries if q["sql"].lstrip().upper().startswith("INSERT")
    ]
    assert len(inserts) == 1
    assert len(queries) == 1
    assert [r.aggregate_version for r in rows] == [1, 2, 3, 4, 5]
    assert OutboxEvent.objects.count() == 5


def test_publish__ids_sort_in_publish_order():
    with transaction.atomic():
        rows = publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(50)]
        )
    assert [r.id for r in rows] == sorted(r.id for r in rows)
    stored = list(
        OutboxEvent.objects.order_by("id").values_list("payload__order_id", flat=True)
    )
    assert stored == list(range(50))


def test_publish__duplicate_aggregate_version():
    with transaction.atomic():
        publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(1)),
            aggregate=("shop.Order", "7"),
            aggregate_version=3,
        )
    with transaction.atomic():
        with (
            pytest.raises(DuplicateAggregateVersion, match="shop.Order:7"),
            transaction.atomic(),
        ):
            publish(
                OrderPlaced(order_id=1, total=decimal.Decimal(2)),
                aggregate=("shop.Order", "7"),
                aggregate_version=3,
            )
        # The savepoint rolled back; the outer transaction goes on.
        publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(3)),
            aggregate=("shop.Order", "7"),
            aggregate_version=4,
        )
    assert sorted(OutboxEvent.objects.values_list("aggregate_version", flat=True)) == [
        3,
        4,
    ]


def test_publish__same_version_of_different_aggregates_is_fine():
    with transaction.atomic():
        publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(1)),
            aggregate=("shop.Order", "1"),
            aggregate_version=1,
        )
        publish(
            OrderPlaced(order_id=2, total=decimal.Decimal(1)),
            aggregate=("shop.Order", "2"),
            aggregate_version=1,
        )
        publish(
            OrderPlaced(order_id=2, total=decimal.Decimal(1)),
            aggregate=("shop.Cart", "1"),
            aggregate_version=1,
        )
    assert OutboxEvent.objects.count() == 3


def test_publish__duplicate_event_id():
    event_id = uuid.uuid4()
    event = {"event_type": "PaymentCaptured", "payload": {"amount": 5}, "id": event_id}
    with transaction.atomic():
        publish(event)
    with pytest.raises(DuplicateOutboxEvent), transaction.atomic():
        publish(event)
    assert OutboxEvent.objects.get().id == event_id


def test_publish__invalid_payload_names_the_field_and_writes_nothing():
    with transaction.atomic():
        with pytest.raises(InvalidPayload, match=r"Untyped\.blob") as info:
            publish({"event_type": "Untyped", "payload": {"ok": 1, "blob": object()}})
        assert info.value.field == "blob"
        with pytest.raises(InvalidPayload, match=r"Untyped\.ratio"):
            publish({"event_type": "Untyped", "payload": {"ratio": float("nan")}})
        with pytest.raises(
            InvalidPayload, match="Event dataclass instance or a mapping"
        ):
            publish("OrderPlaced")
        with pytest.raises(InvalidPayload, match="headers.actor"):
            publish(
                OrderPlaced(order_id=1, total=decimal.Decimal(1)),
                headers={"actor": object()},
            )
    assert not OutboxEvent.objects.exists()


def test_publish__payload_too_large(settings):
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 100
    with transaction.atomic():
        publish({"event_type": "Small", "payload": {"x": "a" * 50}})
        with pytest.raises(PayloadTooLarge, match="OUTBOX_MAX_PAYLOAD_BYTES is 100"):
            publish(
                {"event_type": "Small", "payload": {"x": "a"}},
                {"event_type": "Big", "payload": {"x": "a" * 200}},
            )
    assert list(OutboxEvent.objects.values_list("event_type", flat=True)) == ["Small"]


@pytest.mark.parametrize("bad", ["", "   ", "x" * 256, None, 42])
def test_publish__invalid_event_type(bad):
    with transaction.atomic(), pytest.raises(InvalidEventType):
        publish({"event_type": bad, "payload": {}})
    assert not OutboxEvent.objects.exists()


def test_publish__event_type_of_255_characters_is_accepted():
    with transaction.atomic():
        publish({"event_type": "x" * 255, "payload": {}})
    assert OutboxEvent.objects.get().event_type == "x" * 255


def test_publish__round_trip_of_rich_payloads():
    event = OrderShipped(
        order_id=7,
        shipped_at=datetime.datetime(
            2026, 11, 22, 9, 30, 15, 123456, tzinfo=datetime.UTC
        ),
        delivery_date=datetime.date(2026, 11, 24),
        tracking=uuid.UUID("12345678-1234-5678-1234-567812345678"),
        address=Address(city="Lyon", postcode="69001"),
        parcels=[decimal.Decimal("1.50"), decimal.Decimal("0.25")],
    )
    with transaction.atomic():
        publish(event, headers={"correlation_id": "req-1", "actor": "alice"})
    row = OutboxEvent.objects.get()
    assert row.headers == {"correlation_id": "req-1", "actor": "alice"}
    assert decode(row.event_type, row.revision, row.payload) == event


def test_publish__aggregate_instance_gives_type_id_and_alias():
    with transaction.atomic():
        order = Order.objects.create(reference="X")
        [row] = publish(placed(order), aggregate=order, tenant_id="acme")
    assert row._state.db == "default"
    stored = OutboxEvent.objects.get()
    assert (stored.aggregate_type, stored.aggregate_id, stored.tenant_id) == (
        "testapp.Order",
        str(order.pk),
        "acme",
    )


def test_publish__unsaved_aggregate_is_refused():
    with transaction.atomic(), pytest.raises(InvalidEvent, match="save it first"):
        publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(1)),
            aggregate=Order(reference="new"),
        )
    assert not OutboxEvent.objects.exists()


def test_outbox_action__stamps_every_event():
    with transaction.atomic(), outbox_action("PlaceOrder", {"cart": 3}) as action_id:
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
        publish(OrderPlaced(order_id=2, total=decimal.Decimal(2)))
    rows = OutboxEvent.objects.all()
    assert len(rows) == 2
    assert {(r.action_id, r.action_name) for r in rows} == {(action_id, "PlaceOrder")}
    assert rows[0].action_params == {"cart": 3}
    assert not OutboxEvent.objects.sentinels().exists()


def test_outbox_action__that_publishes_nothing_leaves_one_sentinel(wakeups):
    with (
        transaction.atomic(),
        outbox_action("WalletDeposit", {"amount": "10.00"}) as action_id,
    ):
        pass
    sentinel = OutboxEvent.objects.get()
    assert sentinel.is_sentinel
    assert (sentinel.event_type, sentinel.payload, sentinel.aggregate_type) == (
        None,
        None,
        None,
    )
    assert (sentinel.action_id, sentinel.action_name) == (action_id, "WalletDeposit")
    assert sentinel.action_params == {"amount": "10.00"}
    # Sentinels are not work for the relay.
    assert not OutboxEvent.objects.awaiting_fanout().exists()
    assert wakeups == []


def test_outbox_action__rolled_back_leaves_nothing():
    with pytest.raises(RuntimeError), transaction.atomic(), outbox_action("Failing"):
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
        raise RuntimeError
    with (
        pytest.raises(RuntimeError),
        transaction.atomic(),
        outbox_action("FailingEmpty"),
    ):
        raise RuntimeError
    assert not OutboxEvent.objects.exists()


def test_outbox_action__a_publish_that_failed_and_was_caught_leaves_a_sentinel():
    """The action published nothing: its only publish() raised (and the caller
    caught it in a savepoint), so it still leaves its sentinel row."""
    cart = ("shop.Cart", "s")
    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)), aggregate=cart,
                aggregate_version=1)  # fmt: skip
    with (
        transaction.atomic(),
        outbox_action("Import") as action_id,
        pytest.raises(DuplicateAggregateVersion),
        transaction.atomic(),  # the savepoint the caller catches the error in
    ):
        publish(
            OrderPlaced(order_id=2, total=decimal.Decimal(2)),
            aggregate=cart,
            aggregate_version=1,
        )
    sentinel = OutboxEvent.objects.get(action_id=action_id)
    assert sentinel.is_sentinel and sentinel.action_name == "Import"


def test_outbox_action__a_publish_in_a_rolled_back_savepoint_leaves_a_sentinel():
    with (
        transaction.atomic(),
        outbox_action("Tentative") as action_id,
        pytest.raises(RuntimeError),
        transaction.atomic(),  # a savepoint, rolled back
    ):
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
        raise RuntimeError("changed my mind")
    [row] = OutboxEvent.objects.filter(action_id=action_id)
    assert row.is_sentinel


def test_outbox_action__outside_transaction_raises():
    with pytest.raises(OutboxRequiresActiveTransaction), outbox_action("NoTx"):
        pass
    assert not OutboxEvent.objects.exists()


def test_tenant_isolation():
    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)), tenant_id="tenant_a")
        publish(OrderPlaced(order_id=2, total=decimal.Decimal(1)), tenant_id="tenant_a")
        publish(OrderPlaced(order_id=3, total=decimal.Decimal(1)), tenant_id="tenant_b")
    a = list(OutboxEvent.objects.for_tenant("tenant_a"))
    assert len(a) == 2 and {r.tenant_id for r in a} == {"tenant_a"}
    assert [
        r.payload["order_id"] for r in OutboxEvent.objects.for_tenant("tenant_b")
    ] == [3]
    assert not OutboxEvent.objects.for_tenant("tenant_c").exists()


def test_occurred_and_created_at_are_set():
    before = timezone.now()
    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
    row = OutboxEvent.objects.get()
    assert before <= row.occurred_at <= timezone.now()
    assert row.created_at == row.occurred_at


def test_publish__nul_characters_are_refused_before_the_insert():
    with transaction.atomic():
        with pytest.raises(
            InvalidPayload, match=r"Untyped\.note contains a NUL"
        ) as info:
            publish({"event_type": "Untyped", "payload": {"ok": "x", "note": "a\x00b"}})
        assert info.value.field == "note"
        with pytest.raises(InvalidPayload, match="headers.trace"):
            publish(
                {"event_type": "Untyped", "payload": {}}, headers={"trace": ["\x00"]}
            )
        # A backslash followed by "u0000" is just text.
        publish({"event_type": "Untyped", "payload": {"path": "C:\\u0000"}})
    assert OutboxEvent.objects.get().payload == {"path": "C:\\u0000"}


NUL, SURROGATE = "a\x00b", "a\udcffb"


@pytest.mark.parametrize("bad", [NUL, SURROGATE], ids=["nul", "lone-surrogate"])
@pytest.mark.parametrize(
    "arguments",
    [
        lambda bad: {"aggregate": (bad, "1")},
        lambda bad: {"aggregate": ("shop.Order", bad)},
        lambda bad: {"tenant_id": bad},
        lambda bad: {"operation": bad},
        lambda bad: {"event": {"event_type": bad, "payload": {}}},
    ],
    ids=["aggregate-type", "aggregate-id", "tenant", "operation", "event-type"],
)
def test_unstorable_text_is_refused_before_the_insert_on_every_database(arguments, bad):
    """No database stores NUL alike (PostgreSQL refuses it, MariaDB and SQLite
    keep it), and a lone surrogate is not text any driver encodes: refused as
    bad input everywhere, nothing written."""
    given = arguments(bad)
    event = given.pop("event", {"event_type": "Untyped", "payload": {}})
    with transaction.atomic():
        with pytest.raises(InvalidEvent) as info:
            publish(event, **given)
        publish({"event_type": "Untyped", "payload": {}})  # the transaction goes on
    assert f"{bad!a}" in str(info.value)
    assert OutboxEvent.objects.count() == 1


@pytest.mark.parametrize(
    ("arguments", "field"),
    [
        ({"headers": {"trace": "a\x00b"}}, "trace"),
        ({"headers": {"trace": ["\udcff"]}}, "trace"),
        ({"headers": {"\udcff": 1}}, "\udcff"),
        ({"payload": {"ok": 1, "note": {"deep": "\ud800"}}}, "note"),
        ({"payload": {"\x00": 1}}, "\x00"),
    ],
    ids=["headers-nul", "headers-surrogate", "headers-key", "payload", "payload-key"],
)
def test_unstorable_json_names_its_field(arguments, field):
    payload = arguments.pop("payload", {})
    with pytest.raises(InvalidPayload) as info, transaction.atomic():
        publish({"event_type": "Untyped", "payload": payload}, **arguments)
    assert info.value.field == field
    assert not OutboxEvent.objects.exists()


@pytest.mark.parametrize("bad", [NUL, SURROGATE], ids=["nul", "lone-surrogate"])
def test_an_actions_name_and_params_are_refused_alike(bad):
    with pytest.raises(InvalidEvent), transaction.atomic(), outbox_action(bad):
        pass
    with (
        pytest.raises(InvalidPayload) as info,
        transaction.atomic(),
        outbox_action("Import", {"file": bad}),
    ):
        pass
    assert info.value.field == "file"
    assert not OutboxEvent.objects.exists()


@pytest.mark.parametrize(
    "arguments",
    [
        {"aggregate": ("x" * 151, "1")},
        {"aggregate": ("shop.Order", "1" * 256)},
        {"tenant_id": "t" * 256},
    ],
    ids=["aggregate-type", "aggregate-id", "tenant"],
)
def test_text_longer_than_its_column_is_refused_on_every_database(arguments):
    """PostgreSQL and MariaDB raise DataError, SQLite keeps it: refused alike."""
    with pytest.raises(InvalidEvent, match="characters"), transaction.atomic():
        publish({"event_type": "Untyped", "payload": {}}, **arguments)
    assert not OutboxEvent.objects.exists()


@pytest.fixture
def unique_tenant_index():
    """A unique index of the project's own on the outbox table, whose name
    happens to hold "primary"."""
    table = connection.ops.quote_name(OutboxEvent._meta.db_table)
    with connection.cursor() as cursor:
        cursor.execute(
            f"CREATE UNIQUE INDEX site_primary_tenant ON {table} (tenant_id)"
        )
    yield
    with connection.cursor() as cursor:
        if connection.vendor == "mysql":
            cursor.execute(f"DROP INDEX site_primary_tenant ON {table}")
        else:
            cursor.execute("DROP INDEX site_primary_tenant")


def test_publish__errors_are_classified_by_constraint_not_by_message_text(
    unique_tenant_index,
):
    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)), tenant_id="t")
    # Another constraint (the project's own index): not a duplicate event id.
    with pytest.raises(IntegrityError) as raised, transaction.atomic():
        publish(OrderPlaced(order_id=2, total=decimal.Decimal(2)), tenant_id="t")
    assert not isinstance(
        raised.value, DuplicateOutboxEvent | DuplicateAggregateVersion
    )
    # Ours still are what they are.
    [row] = OutboxEvent.objects.all()
    with pytest.raises(DuplicateOutboxEvent), transaction.atomic():
        publish(
            {"event_type": "OrderPlaced", "payload": {"order_id": 3, "total": "1"},
             "id": row.id}
        )  # fmt: skip


@pytest.mark.parametrize(
    ("event", "kwargs", "message"),
    [
        ({"event_type": "Noted", "paylod": {}}, {}, r"unknown key\(s\) \['paylod'\]"),
        ({"event_type": "Noted", "aggregate": "x"}, {}, r"\['aggregate'\]"),
        ({"event_type": "Noted"}, {"aggregate_version": "3"}, "aggregate_version"),
        ({"event_type": "Noted"}, {"aggregate_version": True}, "aggregate_version"),
        ({"event_type": "Noted", "revision": "2"}, {}, "revision"),
    ],
)
def test_a_misspelt_key_or_a_wrong_type_is_refused_at_the_call(event, kwargs, message):
    from outbox_app.exceptions import InvalidEvent

    with pytest.raises(InvalidEvent, match=message), transaction.atomic():
        publish(event, aggregate=("shop.Order", "1"), **kwargs)
    assert not OutboxEvent.objects.exists()
