"""The delivery engine in one process: fan-out, claims, outcomes, retries,
expiry, requeue, ordering, late subscribers and bad input."""

from __future__ import annotations

import contextlib
import datetime
import decimal
import random
import threading
import time
import uuid

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.conf import outbox_settings
from outbox_app.relay import RelayReport, deliver, fan_out, relay_once
from outbox_app.relay.batch import Batch
from outbox_app.relay.handlers import run_handlers
from outbox_app.relay.outcomes import Outcomes
from outbox_app.relay.registry import get, unregister
from outbox_app.store.lifecycle import State
from outbox_app.store.models import Cursor, Subscription
from tests import kit
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def place(n: int, **kwargs) -> list[OutboxEvent]:
    with transaction.atomic():
        return publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(n)],
            **kwargs,
        )


def later(seconds: float) -> datetime.datetime:
    return timezone.now() + datetime.timedelta(seconds=seconds)


def test_happy_path__every_committed_event_reaches_each_handler_once(handlers):
    handlers("record")
    events = place(20)
    with pytest.raises(RuntimeError), transaction.atomic():
        publish(OrderPlaced(order_id=99, total=decimal.Decimal(1)))
        raise RuntimeError("rolled back")
    report = relay_once()
    assert (report.claimed, report.succeeded) == (40, 40)
    assert SideEffect.objects.filter(handler="record_a").count() == 20
    assert SideEffect.objects.filter(handler="record_b").count() == 20
    assert set(SideEffect.objects.values_list("event_id", flat=True)) == {
        e.id for e in events
    }
    assert not OutboxEvent.objects.awaiting_fanout().exists()
    assert kit.states() == {State.SUCCEEDED: 40}
    # Nothing is delivered twice.
    assert relay_once().claimed == 0
    assert SideEffect.objects.count() == 40


def test_handler_receives_the_event_and_its_context(registered):
    seen = []

    @registered(OrderPlaced, name="ctx")
    def ctx(event, context):
        seen.append((event, context))

    with transaction.atomic():
        [row] = publish(
            OrderPlaced(order_id=5, total=decimal.Decimal("2.50")),
            aggregate=("shop.Order", 5),
            aggregate_version=3,
            headers={"correlation_id": "c-1"},
            tenant_id="t1",
        )
    relay_once()
    [(event, context)] = seen
    assert event == OrderPlaced(order_id=5, total=decimal.Decimal("2.50"))
    assert context.event_id == row.id
    assert (
        context.aggregate_type,
        context.aggregate_id,
        context.aggregate_version,
    ) == (
        "shop.Order",
        "5",
        3,
    )
    assert context.headers == {"correlation_id": "c-1"}
    assert (context.attempt, context.tenant_id, context.subscriber) == (1, "t1", "ctx")
    assert context.occurred_at == row.occurred_at


def test_failing_handler__failed_retried_expired_requeued(registered, settings):
    settings.OUTBOX_MAX_ATTEMPTS = 3
    calls = []

    @registered(OrderPlaced, name="fails")
    def fails(event, context):
        SideEffect.objects.create(handler="fails", event_id=context.event_id)
        calls.append(context.attempt)
        if len(calls) <= 3:
            raise ValueError(f"bad thing #{context.attempt}")

    place(1)
    fan_out()
    # A seeded jitter: the first retry waits 0.32 of its 1 s ceiling, never ~0.
    assert deliver(rng=random.Random(7)).failed == 1
    row = Delivery.objects.get()
    assert (row.state, row.attempts) == (State.FAILED, 1)
    assert row.last_error == "bad thing #1"
    assert row.last_error_type == "builtins.ValueError"
    assert "Traceback" in row.last_traceback and "bad thing #1" in row.last_traceback
    assert row.first_failed_at is not None and row.lease_token is None
    # Backoff: not due when it failed (nor 0.3 s later, however long a loaded
    # machine takes to get here), due after the ceiling (1 s for attempt 1).
    assert row.next_retry_at <= timezone.now() + datetime.timedelta(seconds=1)
    assert deliver(now=row.first_failed_at).claimed == 0
    assert deliver(now=later(1.01)).failed == 1
    assert deliver(now=later(2.01 + 1)).dead == 1
    row.refresh_from_db()
    assert (row.state, row.attempts, row.last_error) == (
        State.DEAD,
        3,
        "bad thing #3",
    )
    assert row.completed_at is not None
    assert deliver(now=later(3600)).claimed == 0  # the dead letter stays put
    # The failed attempts' writes were rolled back.
    assert not SideEffect.objects.exists()
    # An operator requeues it: due now, attempts reset, error kept as history.
    assert Delivery.objects.requeue() == 1
    row.refresh_from_db()
    assert (row.state, row.attempts, row.last_error) == (
        State.PENDING,
        0,
        "bad thing #3",
    )
    assert deliver().succeeded == 1
    row.refresh_from_db()
    assert row.state == State.SUCCEEDED
    assert SideEffect.objects.count() == 1


def test_give_up_on_expires_at_once(registered):
    @registered(OrderPlaced, name="gives_up", give_up_on=(KeyError,))
    def gives_up(event, context):
        raise KeyError("no such customer")

    place(1)
    assert relay_once().dead == 1
    row = Delivery.objects.get()
    assert (row.state, row.attempts, row.last_error_type) == (
        State.DEAD,
        1,
        "builtins.KeyError",
    )


def test_exception_outside_retry_on_expires(registered):
    @registered(OrderPlaced, name="narrow", retry_on=(ConnectionError,))
    def narrow(event, context):
        raise TypeError("a bug, not a transient failure")

    place(1)
    assert relay_once().dead == 1


def test_per_handler_max_attempts(registered, settings):
    settings.OUTBOX_MAX_ATTEMPTS = 10

    @registered(OrderPlaced, name="once", max_attempts=1)
    def once(event, context):
        raise ConnectionError("down")

    place(1)
    assert relay_once().dead == 1


def test_backoff_is_capped_exponential_with_jitter(registered, settings):
    settings.OUTBOX_RETRY_BASE_SECONDS = 10
    settings.OUTBOX_RETRY_MAX_SECONDS = 25

    @registered(OrderPlaced, name="always")
    def always(event, context):
        raise ConnectionError("down")

    place(1)
    fan_out()
    start = timezone.now()
    ceilings = []
    for attempt in range(1, 5):
        report = deliver(
            now=start + datetime.timedelta(days=attempt), rng=random.Random(1)
        )
        assert report.failed == 1
        row = Delivery.objects.get()
        assert row.attempts == attempt
        wait = (
            row.next_retry_at - (start + datetime.timedelta(days=attempt))
        ).total_seconds()
        ceilings.append(min(25, 10 * 2 ** (attempt - 1)))
        assert 0 <= wait <= ceilings[-1]
    assert ceilings == [10, 20, 25, 25]


def test_a_raising_handler_does_not_lose_the_rest_of_its_batch(registered):
    @registered(OrderPlaced, name="picky")
    def picky(event, context):
        if event.order_id % 3 == 0:
            raise ValueError("multiple of three")
        SideEffect.objects.create(handler="picky", event_id=context.event_id)

    place(9)
    report = relay_once()
    assert (report.succeeded, report.failed) == (6, 3)
    assert SideEffect.objects.count() == 6


def test_a_failing_handler_rolls_back_only_its_own_writes(registered):
    """Handlers of one batch share a transaction, each in its own savepoint."""

    @registered(OrderPlaced, name="half")
    def half(event, context):
        SideEffect.objects.create(handler="half", event_id=context.event_id)
        if event.order_id % 2:
            raise ValueError("odd")

    events = place(6)
    report = relay_once()
    assert (report.succeeded, report.failed) == (3, 3)
    kept = set(SideEffect.objects.values_list("event_id", flat=True))
    assert kept == {e.id for e in events if e.payload["order_id"] % 2 == 0}
    failed = Delivery.objects.filter(state=State.FAILED)
    assert set(failed.values_list("last_error", flat=True)) == {"odd"}


def test_a_failing_handler_drops_its_on_commit_callbacks(registered):
    """Handlers that never query the database run without a savepoint; a
    failure still discards what they registered, as atomic() would."""
    sent = []

    @registered(OrderPlaced, name="mailer")
    def mailer(event, context):
        transaction.on_commit(lambda: sent.append(event.order_id))
        if event.order_id == 1:
            raise ConnectionError("smtp down")

    place(3)
    report = relay_once()
    assert (report.succeeded, report.failed) == (2, 1)
    assert sorted(sent) == [0, 2]


def test_a_raising_on_commit_callback_fails_only_its_own_row(registered):
    """A handler's ``on_commit`` callbacks run after its writes committed, each
    guarded: one that raises fails its row (FAILED with the callback's error,
    retried), the relay goes on, and every other callback and row is
    unaffected."""
    sent = []

    @registered(OrderPlaced, name="cb.mailer")
    def mailer(event, context):
        # Idempotent: a retry runs it again over its committed write.
        SideEffect.objects.get_or_create(handler="cb.mailer", event_id=context.event_id)
        transaction.on_commit(lambda: sent.append(("first", event.order_id)))

        def send():
            if event.order_id == 1 and context.attempt == 1:
                raise ConnectionError("smtp down after the commit")
            sent.append(("second", event.order_id))

        transaction.on_commit(send)
        transaction.on_commit(lambda: sent.append(("third", event.order_id)))

    @registered(OrderPlaced, name="cb.pure")
    def pure(event, context):
        transaction.on_commit(lambda: sent.append(("pure", event.order_id)))

    @registered(OrderPlaced, name="cb.writer")
    def writer(event, context):
        SideEffect.objects.create(handler="cb.writer", event_id=context.event_id)

    events = place(3)
    report = relay_once()
    assert (report.succeeded, report.failed, report.dead) == (8, 1, 0)
    assert sorted(sent) == sorted(
        [("first", i) for i in range(3)]
        + [("second", 0), ("second", 2)]
        + [("third", i) for i in range(3)]
        + [("pure", i) for i in range(3)]
    )
    failed = Delivery.objects.get(state=State.FAILED)
    assert (failed.subscriber, failed.event_id) == ("cb.mailer", events[1].id)
    assert failed.last_error == "smtp down after the commit"
    assert failed.last_error_type == "builtins.ConnectionError"
    assert "in send" in failed.last_traceback
    assert failed.next_retry_at > failed.updated_at - datetime.timedelta(seconds=1)
    # Its writes committed before the callbacks ran; the retry runs it again
    # over them (at least once).
    assert SideEffect.objects.filter(handler="cb.mailer").count() == 3
    assert SideEffect.objects.filter(handler="cb.writer").count() == 3
    report = relay_once(now=later(3600))
    assert (report.succeeded, report.failed) == (1, 0)
    assert ("second", 1) in sent
    assert kit.states() == {State.SUCCEEDED: 9}


def test_handlers_with_callbacks_that_never_query_share_one_mark(registered):
    """Marked after their callbacks ran, the rows of a group's handlers that
    registered callbacks still take one UPDATE; a raising callback fails its
    own row only."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    sent = []

    @registered(OrderPlaced, name="cb.notify")
    def notify(event, context):
        def send():
            if event.order_id == 1:
                raise ConnectionError("push gateway down")
            sent.append(event.order_id)

        transaction.on_commit(send)

    place(4)
    fan_out()
    with CaptureQueriesContext(connection) as run:
        report = deliver([get("cb.notify")])
    assert (report.succeeded, report.failed) == (3, 1)
    assert sorted(sent) == [0, 2, 3]
    marks = [
        q["sql"]
        for q in run.captured_queries
        if q["sql"].startswith("UPDATE") and "SUCCEEDED" in q["sql"]
    ]
    assert len(marks) == 1
    failed = Delivery.objects.get(state=State.FAILED)
    assert failed.last_error == "push gateway down"


def test_a_raising_on_commit_callback_expires_its_row_after_its_attempts(
    registered,
):
    @registered(OrderPlaced, name="cb.once", max_attempts=1)
    def once(event, context):
        transaction.on_commit(lambda: 1 / 0)

    place(2)
    report = relay_once()
    assert (report.succeeded, report.dead) == (0, 2)
    rows = Delivery.objects.all()
    assert set(rows.values_list("state", "last_error_type")) == {
        (State.DEAD, "builtins.ZeroDivisionError")
    }


def test_a_robust_on_commit_callback_that_raises_is_logged_not_failed(
    registered, caplog
):
    @registered(OrderPlaced, name="cb.robust")
    def robust(event, context):
        transaction.on_commit(lambda: 1 / 0, robust=True)

    place(1)
    report = relay_once()
    assert (report.succeeded, report.failed) == (1, 0)
    assert "ZeroDivisionError" in caplog.text


def test_a_crash_between_the_commit_and_the_mark_runs_the_handler_again(
    registered,
):
    """Interrupted after the commit, before the mark: the row stays RUNNING
    until its lease runs out, then it is delivered again (at least once)."""
    calls = []

    @registered(OrderPlaced, name="cb.crash")
    def crash(event, context):
        SideEffect.objects.get_or_create(handler="cb.crash", event_id=context.event_id)
        calls.append(context.attempt)
        if context.attempt == 1:
            transaction.on_commit(_interrupt)

    place(1)
    with pytest.raises(KeyboardInterrupt):
        relay_once()
    row = Delivery.objects.get()
    assert row.state == State.RUNNING
    assert SideEffect.objects.count() == 1  # committed before the callback
    assert relay_once().claimed == 0  # its lease holds
    report = relay_once(now=later(outbox_settings.LEASE_SECONDS + 1))
    assert report.succeeded == 1
    assert calls == [1, 2]
    assert Delivery.objects.get().state == State.SUCCEEDED


def _interrupt():
    raise KeyboardInterrupt


def test_handlers_that_never_query_share_one_commit_the_others_get_one_each(
    registered, settings
):
    """No lock a handler takes outlives it: a handler that queried the
    database ends its group."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    # Groups closed by time alone would split on a slow machine.
    settings.OUTBOX_HANDLER_GROUP_SECONDS = 6.0

    @registered(OrderPlaced, name="pure")
    def pure(event, context):
        pass

    @registered(OrderPlaced, name="writer")
    def writer(event, context):
        SideEffect.objects.create(handler="writer", event_id=context.event_id)

    place(4)
    fan_out()
    with CaptureQueriesContext(connection) as pure_run:
        assert deliver([get("pure")]).succeeded == 4
    with CaptureQueriesContext(connection) as writer_run:
        assert deliver([get("writer")]).succeeded == 4

    def count(run, start, word=""):
        return sum(
            q["sql"].startswith(start) and word in q["sql"]
            for q in run.captured_queries
        )

    assert (count(pure_run, "SAVEPOINT"), count(writer_run, "SAVEPOINT")) == (0, 4)
    marks = (
        kit.outcome_writes(pure_run.captured_queries),
        kit.outcome_writes(writer_run.captured_queries),
    )
    assert marks == (1, 4)


def test_with_no_group_seconds_each_handler_is_marked_alone(registered, settings):
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    settings.OUTBOX_HANDLER_GROUP_SECONDS = 0

    @registered(OrderPlaced, name="pure")
    def pure(event, context):
        pass

    place(4)
    fan_out()
    with CaptureQueriesContext(connection) as run:
        assert deliver([get("pure")]).succeeded == 4
    assert kit.outcome_writes(run.captured_queries) == 4


def test_a_handler_that_swallows_a_database_error_fails(registered):
    from django.db import IntegrityError

    @registered(OrderPlaced, name="swallow")
    def swallow(event, context):
        SideEffect.objects.create(handler="swallow", event_id=context.event_id)
        try:
            with transaction.atomic(savepoint=False):
                SideEffect.objects.create(handler="swallow", event_id=context.event_id)
        except IntegrityError:
            pass  # the transaction is now marked for rollback

    place(2)
    report = relay_once()
    assert report.failed == 2
    assert not SideEffect.objects.exists()
    row = Delivery.objects.first()
    assert "marked for rollback" in row.last_error


def test_a_handler_that_swallows_an_aborting_error_fails_on_postgresql(registered):
    """A failed statement caught with no savepoint around it aborts a
    PostgreSQL transaction (MariaDB and SQLite undo the statement alone): the
    handler's attempt fails with TransactionBroken, its writes rolled back."""
    from django.db import DatabaseError, connection

    @registered(OrderPlaced, name="swallow")
    def swallow(event, context):
        SideEffect.objects.create(handler="swallow", event_id=context.event_id)
        with contextlib.suppress(DatabaseError), connection.cursor() as cursor:
            cursor.execute("SELECT * FROM no_such_table")

    place(2)
    report = relay_once()
    if connection.vendor != "postgresql":
        assert report.succeeded == 2
        return
    assert report.failed == 2
    assert not SideEffect.objects.exists()
    row = Delivery.objects.first()
    assert row.last_error.startswith("the handler left the transaction aborted")
    assert row.last_error_type == "outbox_app.exceptions.TransactionBroken"


@pytest.mark.engine("rows")
def test_lost_lease_discards_outcome_and_rolls_back_writes(registered):
    @registered(OrderPlaced, name="slowpoke")
    def slowpoke(event, context):
        SideEffect.objects.create(handler="slowpoke", event_id=context.event_id)

    place(1)
    fan_out()
    mine = Batch.claim(get("slowpoke"), "default", 10, timezone.now(), "me")
    # The lease runs out and another worker claims the row before "me" finishes.
    Batch.claim(get("slowpoke"), "default", 10, later(61), "other")
    report = RelayReport()
    outcomes = Outcomes(mine.gateway, get("slowpoke"), mine.token, report)
    run_handlers(mine, get("slowpoke"), outcomes, threading.Event())
    assert (report.succeeded, report.lost) == (0, 1)
    row = Delivery.objects.get()
    assert (row.state, row.locked_by, row.attempts) == (State.RUNNING, "other", 2)
    assert not SideEffect.objects.exists()  # the handler's write was rolled back


def test_handler_timeout(registered):
    import time

    @registered(OrderPlaced, name="sleepy", timeout=0.2, give_up_on=())
    def sleepy(event, context):
        time.sleep(5)

    place(1)
    assert relay_once().failed == 1
    row = Delivery.objects.get()
    assert row.last_error_type == "outbox_app.exceptions.CallTimeout"


@pytest.mark.engine("rows")
def test_late_subscriber_receives_earlier_events(registered):
    place(3)
    assert fan_out() == 0  # nobody subscribes: the events wait
    assert OutboxEvent.objects.awaiting_fanout().count() == 3
    seen = []

    @registered(OrderPlaced, name="late")
    def late(event, context):
        seen.append(event.order_id)

    assert relay_once().succeeded == 3
    assert sorted(seen) == [0, 1, 2]


def test_alias_keeps_rows_of_a_renamed_handler_flowing(registered):
    @registered(OrderPlaced, name="old.name")
    def old(event, context):
        raise ConnectionError("not yet")

    place(1)
    relay_once()
    unregister("old.name")
    seen = []

    @registered(OrderPlaced, name="new.name", aliases=["old.name"])
    def new(event, context):
        seen.append(context.subscriber)

    assert deliver(now=later(3600)).succeeded == 1
    assert seen == ["old.name"]


def test_bad_stored_payload_fails_only_that_delivery(registered):
    seen = []

    @registered(OrderPlaced, "Mystery", name="tolerant")
    def tolerant(event, context):
        seen.append(event)

    place(2)
    with transaction.atomic():
        publish({"event_type": "Mystery", "payload": {"anything": 1}})
    # A row whose payload no longer fits the class (a field was renamed).
    broken = OutboxEvent.objects.filter(event_type="OrderPlaced").first()
    OutboxEvent.objects.filter(id=broken.id).update(payload={"order": 1, "total": "1"})
    report = relay_once()
    assert (report.succeeded, report.failed) == (2, 1)
    failed = Delivery.objects.get(state=State.FAILED)
    assert failed.event_id == broken.id
    assert failed.last_error_type == "outbox_app.exceptions.EventDecodeError"
    assert "unexpected field(s) order" in failed.last_error
    assert {"anything": 1} in seen  # no class: the handler gets the payload


@pytest.mark.engine("rows")
def test_fan_out_pages_by_id__an_event_committed_late_with_a_lower_id_goes_next(
    handlers,
):
    handlers("record")
    events = place(5)
    assert fan_out(batch_size=2) == 5  # three batches, each after the last
    # A transaction that took its id before the others and committed after
    # this fan-out passed it: the next call takes it.
    late = OutboxEvent.objects.get(id=events[0].id)
    late.id, late.fanned_out, late.position = uuid.UUID(int=1), False, None
    late.save(force_insert=True)
    assert fan_out(batch_size=2) == 1
    per_event = Delivery.objects.filter(event_id=events[1].id).count()
    assert Delivery.objects.filter(event_id=late.id).count() == per_event > 0
    assert fan_out(batch_size=2) == 0


def test_sentinels_are_never_fanned_out(handlers):
    from outbox_app import outbox_action

    handlers("record")
    with transaction.atomic(), outbox_action("Nothing"):
        pass
    assert relay_once().fanned_out == 0
    assert not Delivery.objects.exists()


def test_ordered_handler_delivers_each_aggregate_in_order(registered):
    seen = []

    @registered(Step, name="steps", ordered=True)
    def steps(event, context):
        seen.append((context.aggregate_id, event.position))

    with transaction.atomic():
        for position in range(5):
            for aggregate in ("a", "b"):
                publish(Step(position=position), aggregate=("shop.Cart", aggregate))
    fan_out()
    # Only heads are claimable: one row per aggregate per claim.
    rounds = []
    while True:
        report = deliver(batch_size=100)
        if not report.claimed:
            break
        rounds.append(report.claimed)
    for aggregate in ("a", "b"):
        assert [p for a, p in seen if a == aggregate] == [0, 1, 2, 3, 4]


def test_ordered_by_publish_order_even_against_versions(registered):
    seen = []

    @registered(Step, name="versions", ordered=True)
    def versions(event, context):
        seen.append(context.aggregate_version)

    with transaction.atomic():
        # Published out of version order: publish order decides (a writer
        # that holds the aggregate publishes its versions in order).
        publish(Step(position=3), aggregate=("shop.Cart", "v"), aggregate_version=3)
        publish(Step(position=1), aggregate=("shop.Cart", "v"), aggregate_version=1)
        publish(Step(position=2), aggregate=("shop.Cart", "v"), aggregate_version=2)
    for _ in range(4):
        relay_once()
    assert seen == [3, 1, 2]


def test_ordered__failed_head_waits_expired_head_blocks_only_its_aggregate(
    registered, settings
):
    settings.OUTBOX_MAX_ATTEMPTS = 2
    settings.OUTBOX_RETRY_BASE_SECONDS = 600  # a retry is never due by itself here
    seen = []

    @registered(Step, name="strict", ordered=True)
    def strict(event, context):
        if context.aggregate_id == "stuck" and event.position == 0:
            raise ConnectionError("stuck head")
        seen.append((context.aggregate_id, event.position))

    with transaction.atomic():
        for position in range(3):
            publish(Step(position=position), aggregate=("shop.Cart", "stuck"))
            publish(Step(position=position), aggregate=("shop.Cart", "fine"))
    for _ in range(4):
        relay_once()
    # FAILED head: its aggregate waits, the other flows.
    assert [p for a, p in seen if a == "fine"] == [0, 1, 2]
    assert not [p for a, p in seen if a == "stuck"]
    assert Delivery.objects.get(aggregate_id="stuck", state=State.FAILED)
    deliver(now=later(3600))  # second attempt fails: DEAD head
    head = Delivery.objects.get(aggregate_id="stuck", state=State.DEAD)
    for _ in range(3):
        deliver(now=later(7200))
    assert not [p for a, p in seen if a == "stuck"]  # blocked until an operator acts
    strict_rows = Delivery.objects.for_subscribers(["strict"])
    assert strict_rows.blocked_aggregates() == 1
    assert strict_rows.filter(aggregate_id="stuck", state=State.PENDING).count() == 2
    # Unblock: the operator requeues the head (and the handler is fixed).
    unregister("strict")

    @registered(Step, name="strict", ordered=True)
    def fixed(event, context):
        seen.append((context.aggregate_id, event.position))

    Delivery.objects.filter(id=head.id).requeue()
    for _ in range(4):
        relay_once()
    assert [p for a, p in seen if a == "stuck"] == [0, 1, 2]
    assert strict_rows.blocked_aggregates() == 0


def test_unordered_handler_has_no_aggregate_wait(registered, settings):
    settings.OUTBOX_MAX_ATTEMPTS = 1
    seen = []

    @registered(Step, name="loose")
    def loose(event, context):
        if event.position == 0:
            raise ValueError("first one fails")
        seen.append(event.position)

    with transaction.atomic():
        for position in range(3):
            publish(Step(position=position), aggregate=("shop.Cart", "x"))
    relay_once()
    assert sorted(seen) == [1, 2]


@pytest.mark.engine("rows")
def test_release_hands_back_unattempted_rows(handlers):
    handlers("record")
    place(2)
    fan_out()
    batch = Batch.claim(get("record_a"), "default", 10, timezone.now(), "me")
    assert len(batch) == 2
    assert batch.release().released == 2
    rows = Delivery.objects.all()
    assert set(rows.values_list("state", "attempts")) == {(State.PENDING, 0)}


def test_autodiscovered_handler_delivers():
    from tests.testapp.events import AuditRecorded

    with transaction.atomic():
        [row] = publish(AuditRecorded(note="hello"))
    assert relay_once().succeeded == 1
    assert SideEffect.objects.get(handler="record_audit").event_id == row.id


def test_long_handler_batch_keeps_its_rows_leased(registered, settings):
    """Handlers run one by one; the rows waiting their turn are re-leased, and
    each handler starts with most of a lease ahead of it."""
    import time

    lease = 1.0
    settings.OUTBOX_LEASE_SECONDS = lease
    left = []

    @registered(OrderPlaced, name="slow_batch")
    def slow_batch(event, context):
        # Its lease: its row's, or by stream its cursor's.
        held = (
            Delivery.objects.filter(id=context.delivery_id)
            if context.delivery_id
            else Cursor.objects.filter(subscriber="slow_batch")
        )
        left.append((held.get().locked_until - timezone.now()).total_seconds())
        time.sleep(0.09 if context.event_id != first else 0.45)

    first = place(6)[0].id
    assert relay_once().succeeded == 6
    # 1.0 s of handlers in a 1.0 s lease: every one still started with >= 80%.
    assert min(left) >= 0.8 * lease, left


def test_skipping_an_expired_head_unblocks_its_aggregate(registered, settings):
    settings.OUTBOX_MAX_ATTEMPTS = 1
    seen = []

    @registered(Step, name="skippy", ordered=True)
    def skippy(event, context):
        if event.position == 0:
            raise ValueError("poison")
        seen.append(event.position)

    with transaction.atomic():
        for position in range(3):
            publish(Step(position=position), aggregate=("shop.Cart", "p"))
    relay_once()
    rows = Delivery.objects.for_subscribers(["skippy"])
    assert rows.blocked_aggregates() == 1 and seen == []
    assert rows.filter(state=State.DEAD).skip() == 1
    relay_once()
    assert seen == [1, 2]
    head = rows.get(state=State.SKIPPED)
    assert head.last_error == "poison" and head.completed_at is not None
    assert rows.blocked_aggregates() == 0


def test_backoff_counts_from_the_failure_not_the_claim(registered, settings):
    import time

    settings.OUTBOX_RETRY_BASE_SECONDS = 0.001

    failed_at = {}

    @registered(OrderPlaced, name="slow_failures")
    def slow_failures(event, context):
        time.sleep(0.05)
        failed_at[context.event_id] = timezone.now()
        raise ConnectionError("down")

    place(4)
    assert relay_once().failed == 4
    for row in Delivery.objects.all():
        # Due again after the failure (the claim was up to 0.2 s earlier).
        slack = datetime.timedelta(milliseconds=2)
        assert row.next_retry_at >= failed_at[row.event_id] - slack, (
            row.next_retry_at,
            failed_at[row.event_id],
        )


def test_a_handler_that_swallows_its_timeout_still_fails(registered):
    import time

    from outbox_app import CallTimeout

    @registered(OrderPlaced, name="swallower", timeout=0.1)
    def swallower(event, context):
        SideEffect.objects.create(handler="swallower", event_id=context.event_id)
        # A broad except around slow I/O: common, and wrong here.
        with contextlib.suppress(Exception):
            time.sleep(2)

    place(1)
    assert relay_once().failed == 1
    row = Delivery.objects.get()
    assert row.last_error_type == f"{CallTimeout.__module__}.CallTimeout"
    assert not SideEffect.objects.exists()


def test_nul_characters_in_an_error_are_recorded_escaped(registered):
    @registered(OrderPlaced, name="nul")
    def nul(event, context):
        raise ValueError("bad\x00thing")

    place(1)
    assert relay_once().failed == 1
    assert Delivery.objects.get().last_error == "bad\\x00thing"


def test_a_publisher_reporting_a_non_exception_fails_cleanly(settings):
    from outbox_app.publishers.base import Publisher

    class Sloppy(Publisher):
        def send_batch(self, messages):
            return ["nope" for _ in messages]

    sloppy = Sloppy("sloppy", {})
    Subscription.objects.record([sloppy], "tests")
    place(2)
    fan_out(subscribers=[sloppy])
    report = deliver([sloppy])
    assert report.failed == 2
    row = Delivery.objects.filter(subscriber="sloppy").first()
    assert row.last_error == "Sloppy reported 'nope'"


@pytest.mark.engine("rows")
def test_a_backlog_claims_the_next_batch_while_this_one_is_delivered(
    registered, vendor
):
    """PostgreSQL and MariaDB claim the next batch on a second connection while
    the current one runs; SQLite (one writer) claims one after the other."""
    started = threading.Event()

    @registered("OrderPlaced", name="slow_first")
    def slow_first(event, context):
        if not started.is_set():
            started.set()
            time.sleep(0.5)

    place(10)
    fan_out()
    assert deliver([get("slow_first")], batch_size=5).succeeded == 10
    rows = list(Delivery.objects.order_by("id"))
    lease = datetime.timedelta(seconds=outbox_settings.LEASE_SECONDS)
    # A claim sets next_retry_at to the claim time plus the lease; success
    # leaves it.
    second_claimed = min(row.next_retry_at - lease for row in rows[5:])
    first_done = max(row.completed_at for row in rows[:5])
    if vendor == "sqlite":
        assert second_claimed >= first_done
    else:
        assert second_claimed < first_done


@pytest.mark.engine("rows")
def test_a_batch_claimed_ahead_is_handed_back_when_time_is_up(registered, vendor):
    @registered("OrderPlaced", name="slow")
    def slow(event, context):
        time.sleep(0.05)

    place(10)
    fan_out()
    report = deliver([get("slow")], batch_size=5, max_seconds=0.2)
    ahead = 0 if vendor == "sqlite" else 5
    assert (report.claimed, report.succeeded, report.released) == (5 + ahead, 5, ahead)
    states = Delivery.objects.values_list("state", "attempts")
    assert sorted(states) == [(State.PENDING, 0)] * 5 + [(State.SUCCEEDED, 1)] * 5


@pytest.mark.engine("rows")
def test_without_claim_ahead_a_backlog_is_claimed_batch_after_batch(registered):
    @registered("OrderPlaced", name="slow")
    def slow(event, context):
        time.sleep(0.05)

    place(10)
    fan_out()
    report = deliver([get("slow")], batch_size=5, max_seconds=0.2, claim_ahead=False)
    assert (report.claimed, report.succeeded, report.released) == (5, 5, 0)
    states = Delivery.objects.values_list("state", "attempts")
    assert sorted(states) == [(State.PENDING, 0)] * 5 + [(State.SUCCEEDED, 1)] * 5
