"""Stream delivery's own promises: where a new subscriber's cursor starts,
events committed out of the order their writers began in, a long
transaction open meanwhile, a large tick, a lost cursor lease, retiring and
purging with cursors. The tests of the other modules judge the rest on
whichever engine the suite runs."""

from __future__ import annotations

import datetime
import random
import threading
import time
import uuid

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.models import Subscription
from outbox_app.ops import streams
from outbox_app.ops import subscriptions as operations
from outbox_app.ops.purge import purge
from outbox_app.relay import deliver, relay_once
from outbox_app.relay.loop import SubscriptionView
from outbox_app.relay.registry import get
from outbox_app.store.lifecycle import State
from outbox_app.store.models import Cursor
from outbox_app.subscribers import Handler
from tests import kit
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import Order, SideEffect

from .test_delivery import place

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.engine("stream"),
]


def steps(n: int, aggregate=("shop.Cart", "1")) -> list[OutboxEvent]:
    with transaction.atomic():
        return publish(*[Step(position=i) for i in range(n)], aggregate=aggregate)


def test_a_new_subscriber_starts_at_its_record__or_earliest_when_it_asks(
    registered,
):
    place(2)  # before either subscriber existed
    seen: dict[str, list] = {"now": [], "earliest": []}

    @registered(OrderPlaced, name="from.now")
    def now(event, context):
        seen["now"].append(event.order_id)

    @registered(OrderPlaced, name="from.earliest", start="earliest")
    def earliest(event, context):
        seen["earliest"].append(event.order_id)

    place(3)
    relay_once()
    assert sorted(seen["now"]) == [0, 1, 2]
    assert sorted(seen["earliest"]) == [0, 0, 1, 1, 2]
    # Nothing waits: what came before a subscriber is not its.
    assert streams.awaited() == 0


def test_an_event_before_the_subscriber_is_not_listed_as_its_delivery(registered):
    [before] = place(1)

    @registered(OrderPlaced, name="late")
    def late(event, context):
        pass

    [after] = place(1)
    relay_once()
    assert kit.deliveries([before, after]) == {(after.id, "late"): State.SUCCEEDED}


def test_a_cursor_moves_once_a_batch_and_writes_nothing_per_event(registered, settings):
    from django.test.utils import CaptureQueriesContext

    # One group of handlers for the whole batch, however slow the machine
    # (a group closes after OUTBOX_HANDLER_GROUP_SECONDS).
    settings.OUTBOX_HANDLER_GROUP_SECONDS = 6.0

    @registered(OrderPlaced, name="quiet")
    def quiet(event, context):
        pass

    place(50)
    with CaptureQueriesContext(connection) as run:  # quiet alone, not record_audit
        assert deliver([get("quiet")]).succeeded == 50
    inserts = [q["sql"] for q in run.captured_queries if q["sql"].startswith("INSERT")]
    # No delivery row; one move of the cursor.
    assert not [w for w in inserts if "outbox_app_delivery" in w]
    assert kit.outcome_writes(run.captured_queries) == 1
    assert not Delivery.objects.exists()


@pytest.mark.only_database("postgresql", "mysql")
def test_writers_committing_out_of_order_with_rollbacks_and_a_long_transaction(
    registered,
):
    """Six writers take their transaction id early, then lock an aggregate,
    number its next event and commit after a pause (one in ten rolls back),
    so transactions commit out of the order they began and were numbered in;
    meanwhile a long transaction stays open with an event of its own. An
    ordered handler must get every committed event once, none of a rolled
    back transaction, and each aggregate's events in order."""
    aggregates, writers, seconds = 12, 6, 4.0
    for n in range(aggregates):
        Order.objects.create(reference=str(n), total=0)
    delivered: list[tuple[str, int, uuid.UUID]] = []
    lock = threading.Lock()

    @registered(Step, name="in.order", ordered=True)
    def in_order(event, context):
        with lock:
            delivered.append((context.aggregate_id, event.position, context.event_id))

    stop = threading.Event()
    errors: list[BaseException] = []

    def write(seed: int) -> None:
        rng = random.Random(seed)
        try:
            while not stop.is_set():
                try:
                    with transaction.atomic():
                        # An early write: the transaction id is taken now.
                        SideEffect.objects.create(
                            handler=f"noise-{seed}", event_id=uuid.uuid4()
                        )
                        time.sleep(rng.random() * 0.02)
                        key = rng.randrange(aggregates)
                        order = Order.objects.select_for_update().get(
                            reference=str(key)
                        )
                        order.total += 1
                        order.save(update_fields=["total"])
                        publish(
                            Step(position=int(order.total)),
                            aggregate=("shop.Cart", str(key)),
                        )
                        time.sleep(rng.random() * 0.01)
                        if rng.random() < 0.1:
                            raise _RolledBack
                except _RolledBack:
                    pass
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    def long_transaction() -> None:
        try:
            with transaction.atomic():
                publish(Step(position=1), aggregate=("shop.Cart", "long"))
                stop.wait()
        except BaseException as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    threads.append(threading.Thread(target=long_transaction))
    for thread in threads:
        thread.start()
    ends = time.monotonic() + seconds
    view = SubscriptionView("default")
    try:
        while time.monotonic() < ends:
            relay_once(view=view)
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    for _ in range(20):
        relay_once(view=view)
    view.close()
    assert not errors, errors
    committed = {
        e.id: (e.aggregate_id, e.payload["position"])
        for e in OutboxEvent.objects.filter(event_type="Step")
    }
    ids = [event_id for _, _, event_id in delivered]
    assert len(ids) == len(set(ids)), "delivered twice"
    assert set(ids) == set(committed), (
        f"{len(set(committed) - set(ids))} lost, "
        f"{len(set(ids) - set(committed))} never committed"
    )
    last: dict[str, int] = {}
    for aggregate, position, _ in delivered:
        assert position > last.get(aggregate, 0), (aggregate, position, last)
        last[aggregate] = position
    assert len(committed) > 50


class _RolledBack(Exception):
    pass


def test_a_tick_larger_than_a_batch_is_read_on_in_order(registered):
    """A backlog committed while no relay ran is one tick: its first batch
    comes sorted, the rest is read on in position order, batch after batch;
    later events come in the next ticks."""
    seen = []

    @registered(Step, name="walker", ordered=True)
    def walker(event, context):
        seen.append((context.aggregate_id, event.position))

    for chunk in range(5):
        steps(40, aggregate=("shop.Cart", str(chunk % 2)))
    report = relay_once(batch_size=7)
    steps(3, aggregate=("shop.Cart", "0"))
    report += relay_once(batch_size=7)
    assert report.succeeded == 203
    for cart in ("0", "1"):
        mine = [p for a, p in seen if a == cart]
        assert mine == sorted(mine) or len(set(mine)) < len(mine)
    assert len(seen) == len(set(OutboxEvent.objects.values_list("id"))) == 203


@pytest.mark.only_database("postgresql", "mysql")  # SQLite: one relay per file
def test_a_handler_group_whose_cursor_was_taken_over_commits_nothing(
    registered, settings
):
    """A relay that stalled past its lease: another relay took the cursor and
    delivers; the first one's handler writes are rolled back and its move is
    refused."""
    from outbox_app.relay.stream import Cursors

    settings.OUTBOX_LEASE_SECONDS = 1.0

    @registered(OrderPlaced, name="stalled")
    def stalled(event, context):
        SideEffect.objects.create(handler="stalled", event_id=context.event_id)
        if context.attempt == 1 and not taken.is_set():
            # Meanwhile, the lease runs out and another relay takes over.
            time.sleep(1.2)
            # On a connection of its own; its lease runs for a minute from
            # now (its clock is ahead).
            thread = threading.Thread(target=take_over)
            thread.start()
            thread.join()
            assert taken.is_set()

    def take_over():
        other = Cursors("default", "other:1")
        ahead = timezone.now() + datetime.timedelta(minutes=1)
        if other.of(get("stalled"), ahead):
            taken.set()
        connection.close()

    taken = threading.Event()
    place(2)
    report = relay_once()
    assert report.lost >= 1 and report.succeeded == 0
    assert not SideEffect.objects.exists()
    # The cursor is the other relay's until its lease runs out.
    assert relay_once().claimed == 0
    later = timezone.now() + datetime.timedelta(minutes=2)
    assert relay_once(now=later).succeeded == 2
    assert SideEffect.objects.filter(handler="stalled").count() == 2


def test_a_publisher_batch_sent_after_its_cursor_was_taken_over_is_sent_again(
    settings,
):
    """A relay that stalled in a send past its lease: it counts the batch
    lost and goes on; the relay that took the cursor sends it again (at
    least once)."""
    from outbox_app.publishers.base import Publisher
    from outbox_app.relay.stream import Cursors

    settings.OUTBOX_LEASE_SECONDS = 1.0
    sent = []

    class Stalls(Publisher):
        def send_batch(self, messages):
            sent.extend(m.event_id for m in messages)
            if len(sent) == len(messages):  # the first send stalls
                time.sleep(1.2)
                thread = threading.Thread(target=take_over)
                thread.start()
                thread.join()
            return [None] * len(messages)

    def take_over():
        ahead = timezone.now() + datetime.timedelta(minutes=1)
        Cursors("default", "other:1").of(stalls, ahead)
        connection.close()

    stalls = Stalls("stalls", {})
    assert deliver([stalls]).claimed == 0  # its cursor starts here
    events = place(3)
    report = deliver([stalls])
    assert (report.lost, report.succeeded) == (3, 0)
    later = timezone.now() + datetime.timedelta(minutes=2)
    assert deliver([stalls], now=later).succeeded == 3
    assert sorted(sent) == sorted([e.id for e in events] * 2)


def test_retiring_keeps_or_skips_what_the_cursor_has_not_read(handlers):
    handlers("record")
    Subscription.objects.record(
        [Handler(name="gone", event_types=frozenset({"OrderPlaced"}))], "other:1"
    )
    place(3)
    relay_once()  # the others deliver; gone's events wait in its stream
    assert kit.states("gone") == {State.PENDING: 3}
    assert operations.retire(
        Subscription.objects.filter(subscriber="gone"),
        waiting="keep",
        by="t",
        force=True,
    ) == (1, 0)
    # Kept: rows a relay that has it delivers.
    assert set(
        Delivery.objects.filter(subscriber="gone").values_list("state", flat=True)
    ) == {State.PENDING}
    place(2)
    relay_once()
    assert Delivery.objects.filter(subscriber="gone").count() == 3
    operations.reactivate(Subscription.objects.filter(subscriber="gone"))
    place(1)
    assert operations.retire(
        Subscription.objects.filter(subscriber="gone"),
        waiting="skip",
        by="t",
        force=True,
    ) == (1, 4)  # 3 kept rows and 1 unread event
    assert kit.states("gone")[State.SKIPPED] == 4


def test_purge_deletes_what_every_cursor_read__not_what_one_has_still_to(handlers):
    handlers("record")
    Subscription.objects.record(
        [Handler(name="behind", event_types=frozenset({"Step"}))], "other:1"
    )
    orders = place(3)
    waiting = steps(2)
    relay_once()  # behind's Step events wait in its stream
    assert purge(older_than_days=0).events == 3
    assert set(OutboxEvent.objects.values_list("id", flat=True)) == {
        e.id for e in waiting
    }
    del orders


def test_a_byte_budget_cuts_a_stream_batch_and_a_large_event_goes_alone(
    registered, settings
):
    settings.OUTBOX_BATCH_BYTES = 2100
    batches = []

    @registered("Blob", name="bytes")
    def blob(event, context):
        batches.append(context.position)

    with transaction.atomic():
        publish(
            *[
                {"event_type": "Blob", "payload": {"blob": "x" * size}}
                for size in (1000, 1000, 1000, 5000, 10)
            ]
        )
    report = relay_once()
    assert report.succeeded == 5
    assert len(batches) == 5


def test_the_streams_backlog_counts_what_a_cursor_has_still_to_read(handlers):
    handlers("record")
    place(4)
    assert streams.awaited() == 4  # per event, whichever cursor waits
    relay_once()
    assert streams.awaited() == 0
    assert connections["default"].vendor


def _ordered_effects() -> dict[str, list[int]]:
    """The ordered handler's committed side effects: positions per
    aggregate, in the order they were written."""
    found: dict[str, list[int]] = {}
    for aggregate, position in (
        SideEffect.objects.filter(handler="ordered")
        .order_by("id")
        .values_list("aggregate", "position")
    ):
        found.setdefault(aggregate, []).append(position)
    return found


def _publish_steps(aggregates: int, per_aggregate: int, start: int = 0) -> None:
    for position in range(start, start + per_aggregate):
        with transaction.atomic():
            for aggregate in range(aggregates):
                publish(
                    Step(position=position), aggregate=("shop.Cart", str(aggregate))
                )


@pytest.mark.slow
@pytest.mark.only_database("postgresql", "mysql")
def test_two_relays_share_a_subscriber_s_partitions_and_keep_each_aggregate_in_order(
    handlers,
):
    """With four partitions, a second relay asks for its share: each relay
    ends up holding two, every event is delivered once, and each aggregate's
    in order, whichever relay delivered it."""
    from tests.processes import spawn, wait_for

    handlers("ordered")  # recorded, as a deploy does
    _publish_steps(20, 10)
    env = {
        "OUTBOX_TEST_PARTITIONS": "4",
        "OUTBOX_TEST_LEASE": "10",
        "OUTBOX_TEST_RETRY_BASE": "0.01",
        "OUTBOX_TEST_RETRY_MAX": "0.05",
    }
    relays = [
        spawn("-m", "tests.relay_worker", "ordered", "--max-seconds", "120", **env)
        for _ in range(2)
    ]
    holders: set[str] = set()
    try:
        for relay in relays:
            assert relay.stdout.readline().strip() == "ready"

        def shared() -> bool:
            _publish_steps(20, 1, start=100 + len(holders))
            holders.update(
                Cursor.objects.exclude(locked_by="").values_list("locked_by", flat=True)
            )
            return len(holders) == 2

        wait_for(shared, 60, "both relays to hold partitions")
        wait_for(
            lambda: (
                streams.awaited() == 0
                and not Delivery.objects.exclude(state=State.SUCCEEDED).exists()
            ),
            120,
            "every event delivered",
        )
    finally:
        for relay in relays:
            relay.terminate()
            relay.communicate(timeout=60)
    committed = OutboxEvent.objects.filter(event_type="Step").count()
    effects = _ordered_effects()
    assert sum(len(p) for p in effects.values()) == committed
    for aggregate, positions in effects.items():
        assert positions == sorted(positions), aggregate
    assert Cursor.objects.filter(subscriber="ordered", partitions=4).count() == 4


@pytest.mark.slow
@pytest.mark.only_database("postgresql", "mysql")
def test_changing_the_partitions_loses_nothing_and_delivers_nothing_twice(handlers):
    """A relay started with three partitions, where the cursors have two,
    stops them at one tick and makes three that read on from there: every
    event delivered once, each aggregate in order across the change."""
    from tests.processes import spawn, wait_for

    handlers("ordered")
    _publish_steps(12, 5)
    two = spawn(
        "-m",
        "tests.relay_worker",
        "ordered",
        "--max-seconds",
        "60",
        OUTBOX_TEST_PARTITIONS="2",
        OUTBOX_TEST_LEASE="10",
    )
    three = None
    try:
        assert two.stdout.readline().strip() == "ready"
        cursors = Cursor.objects.filter(subscriber="ordered")
        wait_for(lambda: cursors.filter(partitions=2).count() == 2, 30, "2 cursors")
        _publish_steps(12, 5, start=5)
        three = spawn(
            "-m",
            "tests.relay_worker",
            "ordered",
            "--max-seconds",
            "120",
            OUTBOX_TEST_PARTITIONS="3",
            OUTBOX_TEST_LEASE="10",
        )
        assert three.stdout.readline().strip() == "ready"
        _publish_steps(12, 5, start=10)
        wait_for(
            lambda: not cursors.filter(partitions=2).exists(),
            90,
            "the two cursors drained and gone",
        )
        _publish_steps(12, 5, start=15)
        wait_for(
            lambda: (
                streams.awaited() == 0
                and not Delivery.objects.exclude(state=State.SUCCEEDED).exists()
            ),
            120,
            "every event delivered",
        )
    finally:
        for relay in (two, three):
            if relay is not None:
                relay.terminate()
                relay.communicate(timeout=60)
    effects = _ordered_effects()
    assert sum(len(p) for p in effects.values()) == 12 * 20
    for aggregate, positions in effects.items():
        assert positions == list(range(20)), aggregate
    assert Cursor.objects.filter(subscriber="ordered", partitions=3).count() == 3


def test_operators_see_each_cursor_with_what_it_has_still_to_read(handlers):
    """The overview, ``outbox_status`` and the metrics show each cursor: the
    events it has still to read, the age of the oldest, who holds it."""
    import io

    from django.core.management import call_command

    from outbox_app.ops import status
    from outbox_app.ops.metrics import exposition

    handlers("record")
    place(3)
    data = status.overview()
    waiting = {c["subscriber"]: c for c in data["streams"]}
    assert waiting["record_a"]["waiting"] == waiting["record_b"]["waiting"] == 3
    assert waiting["record_a"]["oldest_waiting_seconds"] is not None
    assert data["lag_seconds"] is not None
    row = {r["name"]: r for r in data["subscribers"]}["record_a"]
    assert row["stream"]["waiting"] == 3
    listed = io.StringIO()
    call_command("outbox_subscribers", stdout=listed, no_color=True)
    [line] = [x for x in listed.getvalue().splitlines() if x.startswith("record_a ")]
    assert line.split()[-1] == "3"  # its waiting events
    text, _ = exposition()
    assert b'outbox_stream_waiting_events{partition="0",subscriber="record_a"} 3.0' in (
        text
    )
    relay_once()
    data = status.overview()
    caught_up = {c["subscriber"]: c for c in data["streams"]}["record_a"]
    assert (caught_up["waiting"], caught_up["oldest_waiting_seconds"]) == (0, None)
    assert caught_up["last_tick"] is not None
    # Delivered by stream: counted in the minute published, once a subscriber.
    assert data["deliveries"]["total"] == 6
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "stream record_a: 0 waiting" in out.getvalue()


def test_the_admin_shows_the_cursors_and_each_subscriber_s_delivery_of_an_event(
    handlers, admin_client
):
    from django.urls import reverse

    handlers("record")
    Subscription.objects.record(
        [Handler(name="behind", event_types=frozenset({"OrderPlaced"}))], "other:1"
    )
    [event] = place(1)
    relay_once()
    page = admin_client.get(reverse("admin:outbox_app_cursor_changelist"))
    text = page.content.decode()
    assert page.status_code == 200
    assert "record_a" in text and "behind" in text and "1 of 1" in text
    page = admin_client.get(
        reverse("admin:outbox_app_outboxevent_change", args=[event.pk])
    )
    text = page.content.decode()
    assert "record_a: delivered (its stream read past it)" in text
    assert "behind: waiting in its stream" in text


def test_an_upgrade_from_row_delivery_loses_nothing_and_delivers_nothing_twice(
    registered, settings
):
    """A deployment on row delivery switches: the rows it left (PENDING, a
    RUNNING one under a lease of a relay that died, FAILED) and the events
    not fanned out yet are delivered as rows, the events written afterwards
    by stream, each once, in order per aggregate."""
    from outbox_app.relay import fan_out

    settings.OUTBOX_ENGINE = "rows"
    seen = []

    @registered(Step, name="upgraded", ordered=True)
    def upgraded(event, context):
        if (context.aggregate_id, event.position, context.attempt) == ("a", 1, 1):
            raise ConnectionError("failed once before the upgrade")
        seen.append((context.aggregate_id, event.position))

    steps(3, aggregate=("shop.Cart", "a"))  # 0, 1, 2 of a: fanned out below
    fan_out()
    # a0 delivered, a1 FAILED, a2 waits behind it. A clock held still: a1's
    # retry (full jitter, possibly a few milliseconds) is not due in the call
    # however long a loaded machine takes over it.
    relay_once(now=timezone.now())
    running = steps(1, aggregate=("shop.Cart", "b"))  # b0: claimed by a relay...
    fan_out()
    Delivery.objects.filter(event_id=running[0].id).update(
        state=State.RUNNING,
        attempts=1,
        locked_by="old:1",
        lease_token=uuid.uuid4(),
        next_retry_at=timezone.now() + datetime.timedelta(seconds=30),
    )  # ...that died holding it
    steps(1, aggregate=("shop.Cart", "c"))  # c0: never fanned out
    assert ("a", 0) in seen and len(seen) == 1

    settings.OUTBOX_ENGINE = "stream"  # the deploy
    with transaction.atomic():
        publish(Step(position=3), aggregate=("shop.Cart", "a"))
        publish(Step(position=1), aggregate=("shop.Cart", "b"))
        publish(Step(position=1), aggregate=("shop.Cart", "c"))
    later = timezone.now() + datetime.timedelta(minutes=20)
    for _ in range(4):
        relay_once(now=later)
    by_cart: dict[str, list[int]] = {}
    for cart, position in seen:
        by_cart.setdefault(cart, []).append(position)
    assert by_cart == {"a": [0, 1, 2, 3], "b": [0, 1], "c": [0, 1]}
    assert kit.states("upgraded") == {State.SUCCEEDED: 8}


def test_a_relay_inside_the_transaction_that_published_delivers_each_event_once(
    registered,
):
    """As in a test case whose transaction never commits: events published,
    the relay run, more published, the relay run again, in one transaction:
    each event delivered once (a tick counts the reader's own transaction as
    committed, so its later events are read on their own)."""
    seen = []

    @registered(OrderPlaced, name="in.test")
    def in_test(event, context):
        seen.append(event.order_id)

    with transaction.atomic():
        place(2)
        relay_once()
        with transaction.atomic():
            publish(OrderPlaced(order_id=7, total=1))
        relay_once()
        relay_once()
        assert sorted(seen) == [0, 1, 7]
        transaction.set_rollback(True)
    place(1)
    relay_once()
    assert sorted(seen) == [0, 0, 1, 7]


def test_a_subscriber_nobody_recorded_receives_what_its_process_publishes():
    """A handler added since the last ``migrate`` (or a test's): the first
    publish() of a process that has it gives it its cursor inside the
    publishing transaction, so the events that transaction writes are its,
    even after other writes of the transaction; a rolled-back one leaves it
    to the next."""
    from outbox_app import handler
    from outbox_app.relay.registry import unregister

    seen = []
    handler(OrderPlaced, name="unrecorded")(lambda event, context: seen.append(event))
    try:
        with transaction.atomic():
            Order.objects.create(reference="rolled back")
            place(1)
            transaction.set_rollback(True)
        assert not Cursor.objects.filter(subscriber="unrecorded").exists()
        with transaction.atomic():
            Order.objects.create(reference="a")  # the transaction has written
            [event] = place(1)
        relay_once()
        assert [e.order_id for e in seen] == [event.payload["order_id"]]
        assert kit.deliveries([event]) == {(event.id, "unrecorded"): State.SUCCEEDED}
    finally:
        unregister("unrecorded")


@pytest.mark.only_database("postgresql", "mysql")  # SQLite: one writer at a time
def test_a_long_transaction_giving_a_subscriber_its_cursors_holds_up_nobody():
    """The first write of a process after a subscriber appears gives it its
    cursors; when that write is a long transaction, other writers and the
    relay go on without waiting for it to end, and once it commits the
    subscriber receives its event and every one committed meanwhile."""
    from outbox_app import handler
    from outbox_app.relay.registry import unregister

    seen = []
    handler(Step, name="unrecorded")(
        lambda event, context: seen.append(context.event_id)
    )
    opened, done = threading.Event(), threading.Event()
    waited: list[bool] = []

    def long_transaction() -> None:
        try:
            with transaction.atomic():
                publish(Step(position=0), aggregate=("shop.Cart", "long"))
                opened.set()
                # Ended by the test once the others went on, or after 20 s
                # should they wait for it.
                waited.append(not done.wait(20))
        finally:
            connection.close()

    thread = threading.Thread(target=long_transaction)
    thread.start()
    try:
        assert opened.wait(10)
        others = steps(3)
        relay_once()
        assert seen == []  # its cursors are the long transaction's to give
    finally:
        done.set()
        thread.join(30)
        try:
            relay_once()
        finally:
            unregister("unrecorded")
    assert waited == [False], "a writer or the relay waited for the transaction"
    [long] = OutboxEvent.objects.filter(aggregate_id="long")
    assert sorted(seen, key=str) == sorted([long.id, *(e.id for e in others)], key=str)


def test_a_backlog_larger_than_a_tick_is_delivered_in_one_pass(registered):
    """Events committed while no relay ran, more than one tick takes where
    the relays number events (MySQL/MariaDB: up to 1,000 a tick): one
    ``relay_once`` delivers them all, each once, in order; a subscriber
    that first appears then receives none of them."""
    seen, late = [], []

    @registered(Step, name="backlog")
    def backlog(event, context):
        seen.append(event.position)

    for start in range(0, 2500, 500):
        with transaction.atomic():
            publish(*[Step(position=start + i) for i in range(500)])
    get("backlog")  # recorded before the events; the next one is not
    from outbox_app import handler
    from outbox_app.relay.registry import unregister

    handler(Step, name="late")(lambda event, context: late.append(event))
    try:
        relay_once()
        with transaction.atomic():
            publish(Step(position=2500))
        relay_once()
    finally:
        unregister("late")
    assert seen == list(range(2501))
    assert [e.position for e in late] == [2500]


@pytest.mark.only_database("mysql")
def test_events_numbered_again_after_the_sequencer_s_row_was_deleted(registered):
    """The row that records the last number given is deleted (an operator's
    cleanup, a truncated table): the next relay creates it again at the
    highest number an event or a cursor holds, so no number is given twice
    and no event is skipped or delivered twice."""
    from outbox_app.models import Sequencer

    seen = []

    @registered(Step, name="numbered")
    def numbered(event, context):
        seen.append(event.position)

    with transaction.atomic():
        publish(*[Step(position=i) for i in range(3)])
    relay_once()
    Sequencer.objects.all().delete()
    with transaction.atomic():
        publish(*[Step(position=i) for i in range(3, 6)])
    relay_once()
    Sequencer.objects.all().delete()
    OutboxEvent.objects.filter(event_type="Step").delete()  # purged, say
    with transaction.atomic():
        publish(Step(position=6))
    relay_once()
    assert seen == list(range(7))


def test_a_relay_that_stops_hands_its_cursors_back(handlers):
    """``manage.py relay --once`` done (or a relay's SIGTERM): no cursor is
    left under its lease, so the next relay reads on at once."""
    from outbox_app.relay.worker import RelayWorker

    handlers("record")
    place(2)
    RelayWorker(once=True).run()
    assert kit.succeeded() == 4
    assert not kit.taken()


@pytest.mark.only_database("postgresql")
def test_a_group_whose_connection_breaks_leaves_the_group_before_it_delivered(
    registered,
):
    """A handler that queries commits its group at once; the next group's
    connection is cut (a database outage) before its outcome is written: the
    cursor goes back to where that group began, not past the group that
    committed, whose event is not run again."""
    from django.db import DatabaseError

    from outbox_app.relay.loop import SubscriptionView

    runs = []

    @registered(Step, name="writes")
    def writes(event, context):
        runs.append(event.position)
        if event.position == 1 and runs.count(1) == 1:
            with connection.cursor() as cursor:  # the connection is cut
                cursor.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        SideEffect.objects.create(
            handler="writes", event_id=context.event_id, position=event.position
        )

    steps(2)
    view = SubscriptionView("default")
    try:
        with pytest.raises(DatabaseError):
            relay_once(view=view)
        connection.close()
        relay_once(view=view)
        relay_once(view=view)
    finally:
        view.close()
    assert runs == [0, 1, 1]
    assert SideEffect.objects.filter(handler="writes").count() == 2
