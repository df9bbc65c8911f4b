"""The transactional inbox in one process: receive() and retry_due() on every
database (the broker side is in test_consume.py)."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import threading
import uuid

import pytest
from django.db import connection, transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import CallTimeout, InboxMessage, UndecodableMessage
from outbox_app.inbox import receive, receive_batch, retry_due
from outbox_app.store.clock import database_now
from outbox_app.store.lifecycle import InboxState
from tests.inbox.conftest import LATER, QUEUE, batch_of, message, mine
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def recorded(consumer):
    """``record``: writes a SideEffect per OrderPlaced; fails for order ids in
    ``record.failing``."""
    seen = []

    @consumer(OrderPlaced, name="record")
    def record(event, context):
        seen.append((event, context))
        if event.order_id in record.failing:
            raise RuntimeError(f"order {event.order_id} is broken")
        SideEffect.objects.create(
            handler="record", event_id=context.event_id, position=event.order_id
        )

    record.failing = set()
    record.seen = seen
    return record


def test_a_message_is_handled_once_however_often_it_arrives(recorded):
    once = message(7)
    assert receive(once, QUEUE, mine()).handled == 1
    again = receive(once, QUEUE, mine())
    assert (again.handled, again.duplicates) == (0, 1)
    assert SideEffect.objects.filter(handler="record").count() == 1
    row = InboxMessage.objects.get()
    assert (row.consumer, row.state, row.attempts) == ("record", InboxState.HANDLED, 1)
    assert row.body == ""  # kept only while it may run again
    [(event, context)] = recorded.seen
    assert event == OrderPlaced(order_id=7, total=decimal.Decimal("9.99"))
    assert context.headers == {"correlation_id": "req-1"}
    assert (context.source, context.aggregate_id, context.attempt) == ("shop", "1", 1)
    assert context.event_id == uuid.UUID(row.message_id)


def test_the_consumers_writes_and_the_inbox_row_commit_together(recorded):
    recorded.failing.add(3)
    assert receive(message(3), QUEUE, mine()).failed == 1
    assert not SideEffect.objects.exists()  # rolled back with the attempt
    row = InboxMessage.objects.get()
    assert row.state == InboxState.FAILED
    assert "order 3 is broken" in row.last_error
    assert row.last_error_type == "builtins.RuntimeError"
    assert "Traceback" in row.last_traceback
    assert row.body and row.next_retry_at >= row.updated_at  # full jitter: maybe now
    # A redelivery of a message kept to retry is a duplicate: the inbox owns it.
    assert (
        receive(
            message(3, event_id=uuid.UUID(row.message_id)), QUEUE, mine()
        ).duplicates
        == 1
    )
    recorded.failing.clear()
    assert retry_due(mine(), now=timezone.now() + LATER).handled == 1
    row.refresh_from_db()
    assert (row.state, row.attempts, row.body) == (InboxState.HANDLED, 2, "")
    assert recorded.seen[-1][1].attempt == 2
    assert SideEffect.objects.count() == 1


def test_a_poison_message_is_parked_and_the_others_flow(consumer):
    @consumer(OrderPlaced, name="strict", max_attempts=2)
    def strict(event, context):
        if event.order_id == 13:
            raise ValueError("unlucky")
        SideEffect.objects.create(handler="strict", event_id=context.event_id)

    receive(message(13), QUEUE, mine())
    for n in range(3):
        assert receive(message(n), QUEUE, mine()).handled == 1
    assert retry_due(mine(), now=timezone.now() + LATER).dead == 1
    poison = InboxMessage.objects.get(state=InboxState.DEAD)
    assert poison.attempts == 2 and poison.last_error == "unlucky"
    assert retry_due(mine(), now=timezone.now() + 2 * LATER).handled == 0
    assert SideEffect.objects.count() == 3


def test_an_undecodable_message_is_parked_for_each_consumer_of_its_queue(recorded):
    tally = receive(b"\xff not json", QUEUE, mine(), message_id="m-1")
    assert tally.dead == 1
    row = InboxMessage.objects.get()
    assert (row.message_id, row.state) == ("m-1", InboxState.DEAD)
    assert row.last_error_type == "outbox_app.exceptions.UndecodableMessage"
    assert row.body.startswith("\\xff not json")
    assert receive(b'{"id": "x"}', QUEUE, mine()).dead == 1  # keyed by digest
    assert (
        "no specversion, source, type" in InboxMessage.objects.latest("id").last_error
    )
    assert issubclass(UndecodableMessage, Exception)


def test_a_type_no_class_defines_arrives_as_its_data(consumer):
    got = []

    @consumer("ForeignThing", name="foreign")
    def foreign(event, context):
        got.append((event, context.event_id, context.message_id))

    receive(
        message(event_type="ForeignThing", payload={"a": 1}, event_id=uuid.UUID(int=5)),
        QUEUE,
        mine(),
    )
    assert got == [({"a": 1}, uuid.UUID(int=5), str(uuid.UUID(int=5)))]
    assert receive(message(), QUEUE, mine()).ignored == 1  # OrderPlaced: nobody's


def test_an_ordered_consumer_holds_an_aggregate_behind_its_failing_message(consumer):
    order = []
    broken = {1}

    @consumer(OrderPlaced, name="ordered", ordered=True)
    def ordered(event, context):
        if event.order_id in broken:
            raise RuntimeError("not yet")
        order.append((context.aggregate_id, event.order_id))

    assert receive(message(1, aggregate="A"), QUEUE, mine()).failed == 1
    assert receive(message(2, aggregate="A"), QUEUE, mine()).waiting == 1
    assert receive(message(3, aggregate="B"), QUEUE, mine()).handled == 1
    assert order == [("B", 3)]
    broken.clear()
    tally = retry_due(mine(), now=timezone.now() + LATER)
    assert tally.handled == 2
    assert order == [("B", 3), ("A", 1), ("A", 2)]


def test_two_consumers_of_one_queue_each_handle_it_once(recorded, consumer):
    @consumer(OrderPlaced, name="audit")
    def audit(event, context):
        SideEffect.objects.create(handler="audit", event_id=context.event_id)

    recorded.failing.add(1)
    tally = receive(message(1), QUEUE, mine())
    assert (tally.handled, tally.failed) == (1, 1)  # audit ran, record failed
    assert set(InboxMessage.objects.values_list("consumer", "state")) == {
        ("audit", InboxState.HANDLED),
        ("record", InboxState.FAILED),
    }


@skipUnlessDBFeature("has_select_for_update_skip_locked")  # SQLite: one writer
def test_the_same_message_at_two_processes_at_once_has_one_effect(consumer):
    """A redelivery racing the first delivery (a consumer that lost its
    connection mid-message): the second INSERT waits for the first
    transaction, then finds its row."""
    inside, release = threading.Event(), threading.Event()

    @consumer(OrderPlaced, name="slow")
    def slow(event, context):
        SideEffect.objects.create(handler="slow", event_id=context.event_id)
        if not inside.is_set():
            inside.set()
            release.wait(10)

    body_ = message(1)
    tallies = []

    def run():
        try:
            tallies.append(receive(body_, QUEUE, mine()))
        finally:
            connection.close()

    first = threading.Thread(target=run)
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=run)
    second.start()
    second.join(1)
    assert second.is_alive()  # waiting on the first's row
    release.set()
    first.join(10)
    second.join(10)
    assert sorted((t.handled, t.duplicates) for t in tallies) == [(0, 1), (1, 0)]
    assert SideEffect.objects.filter(handler="slow").count() == 1


def test_purge_deletes_handled_messages_past_the_inbox_retention(recorded, settings):
    from outbox_app.ops.purge import purge

    settings.OUTBOX_INBOX_RETENTION_DAYS = 7
    recorded.failing.add(2)
    receive(message(1), QUEUE, mine())
    receive(message(2), QUEUE, mine())
    InboxMessage.objects.update(
        handled_at=timezone.now() - datetime.timedelta(days=8),
        received_at=timezone.now() - datetime.timedelta(days=8),
    )
    receive(message(3), QUEUE, mine())  # handled today
    counts = purge(pause_ratio=0)
    assert counts.inbox == 1
    assert sorted(InboxMessage.objects.values_list("state", flat=True)) == [
        InboxState.FAILED,  # never purged, however old
        InboxState.HANDLED,
    ]


def test_the_admin_shows_a_parked_message_and_requeues_it(consumer, client, admin_user):
    broken = {True}

    @consumer(OrderPlaced, name="picky", max_attempts=1)
    def picky(event, context):
        if broken:
            raise ValueError("cannot take it")
        SideEffect.objects.create(handler="picky", event_id=context.event_id)

    assert receive(message(5), QUEUE, mine()).dead == 1
    row = InboxMessage.objects.get()
    client.force_login(admin_user)
    listing = client.get("/admin/outbox_app/inboxmessage/?state__exact=DEAD")
    assert listing.status_code == 200
    assert listing.context["cl"].result_count == 1
    assert "cannot take it" in listing.content.decode()
    page = client.get(f"/admin/outbox_app/inboxmessage/{row.id}/change/").content
    assert b"Traceback" in page and b"OrderPlaced" in page
    done = client.post(
        "/admin/outbox_app/inboxmessage/",
        {"action": "requeue_selected", "_selected_action": [row.id]},
        follow=True,
    )
    assert "1 message requeued" in done.content.decode()
    row.refresh_from_db()
    assert (row.state, row.attempts) == (InboxState.FAILED, 0)
    broken.clear()
    assert retry_due(mine()).handled == 1
    assert SideEffect.objects.filter(handler="picky").count() == 1


def test_outbox_status_and_prometheus_count_the_inbox(recorded):
    import io
    import json

    from django.core.management import call_command

    from outbox_app.ops.metrics import exposition

    recorded.failing.add(2)
    receive(message(1), QUEUE, mine())
    receive(message(2), QUEUE, mine())
    out = io.StringIO()
    call_command("outbox_status", "--json", stdout=out)
    assert json.loads(out.getvalue())["inbox"] == [
        {"consumer": "record", "states": {"HANDLED": 1, "FAILED": 1, "DEAD": 0}}
    ]
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "inbox record: 1 handled, 1 failed, 0 dead" in out.getvalue()
    text = exposition()[0].decode()
    assert 'outbox_inbox_messages{consumer="record",state="failed"} 1.0' in text


def test_a_batch_is_one_insert_and_its_duplicates_run_nothing(
    recorded, django_assert_max_num_queries
):
    before = message(1)
    receive(before, QUEUE, mine())
    twice = message(2)
    bodies = [before, twice, message(3), twice, message(4)]
    # The recorded consumers of the queue and the rows recorded without a
    # source (a SELECT each), the INSERT that skips the duplicates, the first
    # bodies' digests of the duplicates it skipped (a SELECT, only when there
    # are some), one write per consumer call; no savepoint (the transaction's
    # own BEGIN and COMMIT aside).
    with django_assert_max_num_queries(2 + 1 + 1 + 3 + 2):
        tally = receive_batch(batch_of(*bodies), {QUEUE: mine()})
    assert (tally.handled, tally.duplicates) == (3, 2)
    assert sorted(
        SideEffect.objects.filter(handler="record").values_list("position", flat=True)
    ) == [1, 2, 3, 4]
    assert InboxMessage.objects.filter(state=InboxState.HANDLED).count() == 4


def test_a_failing_consumer_in_a_batch_is_called_once_and_the_rest_commit_once(
    recorded,
):
    recorded.failing.add(3)
    bodies = [message(n) for n in (1, 2, 3, 4, 5)]
    tally = receive_batch(batch_of(*bodies), {QUEUE: mine()})
    assert (tally.handled, tally.failed) == (4, 1)
    calls = [event.order_id for event, _ in recorded.seen]
    # The batch ran as one until 3 raised, was rolled back and ran again
    # message by message, 3's failure recorded without calling it again.
    assert calls == [1, 2, 3, 1, 2, 4, 5]
    assert sorted(
        SideEffect.objects.filter(handler="record").values_list("position", flat=True)
    ) == [1, 2, 4, 5]
    failed = InboxMessage.objects.get(state=InboxState.FAILED)
    assert (failed.attempts, failed.last_error) == (1, "order 3 is broken")
    assert "Traceback" in failed.last_traceback
    assert "test_receive.py" in failed.last_traceback  # the consumer's own frame


def test_a_batch_holds_an_ordered_aggregate_behind_its_failed_message(consumer):
    effects = []

    @consumer(OrderPlaced, name="ordered", ordered=True)
    def ordered(event, context):
        if event.order_id == 1:
            raise RuntimeError("first fails")
        effects.append(event.order_id)

    assert receive_batch(batch_of(message(1, aggregate="a")), {QUEUE: mine()}).failed
    tally = receive_batch(
        batch_of(message(2, aggregate="a"), message(3, aggregate="b")), {QUEUE: mine()}
    )
    assert (tally.handled, tally.waiting) == (1, 1)
    assert effects == [3]


def test_an_undecodable_message_in_a_batch_is_parked_and_the_others_handled(
    recorded,
):
    tally = receive_batch(
        batch_of(message(1), b"{not json", message(2)), {QUEUE: mine()}
    )
    assert (tally.handled, tally.dead) == (2, 1)
    assert InboxMessage.objects.get(state=InboxState.DEAD).last_error_type == (
        "outbox_app.exceptions.UndecodableMessage"
    )


@skipUnlessDBFeature("has_select_for_update_skip_locked")  # SQLite: one writer
def test_a_batch_racing_another_process_for_a_message_has_one_effect(consumer):
    """Another process has inserted one of the batch's rows and not committed
    yet: the batch's INSERT waits for it, then skips that row (a duplicate)
    and handles the others."""
    inside, release = threading.Event(), threading.Event()

    @consumer(OrderPlaced, name="slow")
    def slow(event, context):
        SideEffect.objects.create(
            handler="slow", event_id=context.event_id, position=event.order_id
        )
        if threading.current_thread().name == "first":
            inside.set()
            release.wait(10)

    shared = message(1)
    tallies = []

    def run(bodies):
        try:
            tallies.append(receive_batch(batch_of(*bodies), {QUEUE: mine()}))
        finally:
            connection.close()

    first = threading.Thread(target=run, args=([shared],), name="first")
    first.start()
    assert inside.wait(10)
    second = threading.Thread(target=run, args=([message(2), shared, message(3)],))
    second.start()
    second.join(1)
    assert second.is_alive()  # its INSERT waits on the first's row
    release.set()
    first.join(10)
    second.join(10)
    assert sorted((t.handled, t.duplicates) for t in tallies) == [(1, 0), (2, 1)]
    assert sorted(
        SideEffect.objects.filter(handler="slow").values_list("position", flat=True)
    ) == [1, 2, 3]


def test_a_message_arriving_after_its_expiry_is_not_run(recorded):
    now = database_now()  # expiry is judged by the database's clock
    late = message(1, expires_at=now - datetime.timedelta(seconds=1))
    tally = receive(late, QUEUE, mine())
    assert (tally.expired, tally.handled) == (1, 0)
    assert not InboxMessage.objects.exists()  # nothing to deduplicate later
    tally = receive_batch(
        batch_of(message(2, expires_at=now + LATER), late, message(3)),
        {QUEUE: mine()},
    )
    assert (tally.expired, tally.handled) == (1, 2)
    assert [event.order_id for event, _ in recorded.seen] == [2, 3]
    assert recorded.seen[0][1].expires_at is not None


def test_a_batch_from_a_queue_without_consumers_is_ignored(recorded):
    tally = receive_batch([(message(1), "elsewhere", None)], {QUEUE: mine()})
    assert (tally.ignored, tally.handled) == (1, 0)
    assert not InboxMessage.objects.exists()


def test_a_consumer_that_marks_its_transaction_for_rollback_has_failed(consumer):
    """``transaction.set_rollback(True)`` (or a database error caught inside
    an ``atomic()`` that does not roll back by itself) leaves nothing to
    commit: that message fails and is kept; the others of its batch commit."""

    @consumer(OrderPlaced, name="vetoes")
    def vetoes(event, context):
        SideEffect.objects.create(
            handler="vetoes", event_id=context.event_id, position=event.order_id
        )
        if event.order_id == 2:
            transaction.set_rollback(True)

    tally = receive_batch(batch_of(message(1), message(2), message(3)), {QUEUE: mine()})
    assert (tally.handled, tally.failed) == (2, 1)
    assert sorted(SideEffect.objects.values_list("position", flat=True)) == [1, 3]
    failed = InboxMessage.objects.get(state=InboxState.FAILED)
    assert "marked for rollback" in failed.last_error
    assert InboxMessage.objects.filter(state=InboxState.HANDLED).count() == 2
    # Message by message too.
    assert receive(message(2), QUEUE, mine()).failed == 1


def test_a_consumer_that_swallows_a_database_error_has_failed_where_it_aborts(
    consumer,
):
    """A failed statement caught with no savepoint around it (a raw cursor:
    the ORM's own writes mark the transaction for rollback, the test above):
    PostgreSQL aborts the transaction, whose COMMIT would then roll back
    without an error, so that message fails; MariaDB and SQLite undo the
    statement alone, so it is handled."""
    from django.db import DatabaseError

    @consumer(OrderPlaced, name="swallows")
    def swallows(event, context):
        SideEffect.objects.create(
            handler="swallows", event_id=context.event_id, position=event.order_id
        )
        if event.order_id == 2:
            with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
                cursor.execute("SELECT * FROM no_such_table")

    tally = receive_batch(batch_of(message(1), message(2), message(3)), {QUEUE: mine()})
    aborts = connection.vendor == "postgresql"
    assert (tally.handled, tally.failed) == ((2, 1) if aborts else (3, 0))
    positions = sorted(SideEffect.objects.values_list("position", flat=True))
    assert positions == ([1, 3] if aborts else [1, 2, 3])
    if aborts:
        failed = InboxMessage.objects.get(state=InboxState.FAILED)
        assert failed.last_error.startswith("the consumer left the transaction aborted")
        assert failed.last_error_type == "outbox_app.exceptions.TransactionBroken"


def test_a_consumer_running_past_its_timeout_fails_and_the_batch_flows(consumer):
    import time

    @consumer(OrderPlaced, name="slow", timeout=0.2)
    def slow(event, context):
        SideEffect.objects.create(
            handler="slow", event_id=context.event_id, position=event.order_id
        )
        if event.order_id == 2:
            # Swallowed: the attempt has failed all the same.
            with contextlib.suppress(CallTimeout):
                time.sleep(5)

    began = time.monotonic()
    tally = receive_batch(batch_of(message(1), message(2), message(3)), {QUEUE: mine()})
    assert time.monotonic() - began < 3
    assert (tally.handled, tally.failed) == (2, 1)
    assert sorted(SideEffect.objects.values_list("position", flat=True)) == [1, 3]
    failed = InboxMessage.objects.get(state=InboxState.FAILED)
    assert failed.last_error == "consumer ran longer than its timeout of 0.2s"
    assert failed.last_error_type == "outbox_app.exceptions.CallTimeout"
