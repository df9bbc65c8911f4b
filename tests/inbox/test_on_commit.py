"""A consumer's ``transaction.on_commit`` callbacks: taken out of Django's
list and run by the inbox after its commit, each guarded. One that raises
fails its own message (FAILED, retried from the database, then DEAD),
every other callback still runs, nothing escapes to ``consume``."""

from __future__ import annotations

import logging
import uuid

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import InboxMessage
from outbox_app.inbox import receive, receive_batch, retry_due
from outbox_app.store.lifecycle import InboxState
from tests.inbox.conftest import LATER, QUEUE, batch_of, message, mine
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def notifies(consumer):
    """``notifies`` writes a SideEffect and registers two callbacks per
    message: the first raises for the orders in ``notifies.failing``, the
    second never does; ``notifies.broken`` orders make the consumer itself
    raise. ``audit``, a second consumer of the queue, registers one callback.
    ``notifies.ran`` lists (order, attempt or what) of every callback run."""
    ran = []

    @consumer(OrderPlaced, name="notifies", max_attempts=2)
    def notifies(event, context):
        n = event.order_id
        # A fresh event id: a second run's write shows as a second row.
        SideEffect.objects.create(handler="notifies", event_id=uuid.uuid4(), position=n)

        def first(attempt=context.attempt):
            ran.append((n, attempt))
            if n in notifies.failing:
                raise RuntimeError(f"the callback of order {n} failed")

        transaction.on_commit(first)
        transaction.on_commit(lambda: ran.append((n, "second")))
        if n in notifies.broken:
            raise ValueError(f"order {n} is broken")

    @consumer(OrderPlaced, name="audit")
    def audit(event, context):
        transaction.on_commit(lambda: ran.append((event.order_id, "audit")))

    notifies.failing, notifies.broken, notifies.ran = set(), set(), ran
    return notifies


def ran_for(notifies, n: int) -> list:
    return [what for order, what in notifies.ran if order == n]


def assert_failed_by_its_callback(n: int) -> InboxMessage:
    row = InboxMessage.objects.get(consumer="notifies", state=InboxState.FAILED)
    assert (row.attempts, row.last_error) == (1, f"the callback of order {n} failed")
    assert row.last_error_type == "builtins.RuntimeError"
    assert "in first" in row.last_traceback  # the callback's own frame
    assert f'"order_id":{n}' in row.body  # kept to run again
    assert row.next_retry_at is not None
    return row


def test_a_raising_callback_in_a_batch_fails_its_message_and_the_others_run(
    notifies,
):
    notifies.failing.add(2)
    tally = receive_batch(batch_of(*(message(n) for n in (1, 2, 3))), {QUEUE: mine()})
    # notifies: 1 and 3 handled, 2 failed by its callback; audit: 3 handled.
    assert (tally.handled, tally.failed) == (5, 1)
    for n in (1, 2, 3):
        assert ran_for(notifies, n) == [1, "second", "audit"], n
    assert_failed_by_its_callback(2)
    # The consumer's writes had committed; it runs again (at least once).
    notifies.failing.clear()
    assert retry_due(mine(), now=timezone.now() + LATER).handled == 1
    assert ran_for(notifies, 2) == [1, "second", "audit", 2, "second"]
    row = InboxMessage.objects.get(consumer="notifies", attempts=2)
    assert (row.state, row.body) == (InboxState.HANDLED, "")
    assert sorted(
        SideEffect.objects.filter(handler="notifies").values_list("position", flat=True)
    ) == [1, 2, 2, 3]


def test_a_batch_rolled_back_runs_no_callback_of_its_first_pass(notifies):
    """The batch runs as one until 4's consumer raises, is rolled back and
    runs message by message: the callbacks of its first pass never run."""
    notifies.failing.add(2)
    notifies.broken.add(4)
    tally = receive_batch(
        batch_of(*(message(n) for n in (1, 2, 3, 4))), {QUEUE: mine()}
    )
    assert (tally.handled, tally.failed) == (6, 2)
    for n in (1, 2, 3):
        assert ran_for(notifies, n) == [1, "second", "audit"], n
    assert ran_for(notifies, 4) == ["audit"]  # rolled back with notifies' failure
    assert InboxMessage.objects.filter(state=InboxState.FAILED).count() == 2


def test_a_raising_callback_message_by_message(notifies):
    notifies.failing.add(2)
    tallies = [receive(message(n), QUEUE, mine()) for n in (1, 2, 3)]
    assert [(t.handled, t.failed) for t in tallies] == [(2, 0), (1, 1), (2, 0)]
    for n in (1, 2, 3):
        assert ran_for(notifies, n) == [1, "second", "audit"], n
    assert_failed_by_its_callback(2)


def test_a_callback_raising_on_every_retry_parks_its_message(notifies):
    notifies.failing.add(2)
    notifies.broken.add(5)
    receive_batch(batch_of(message(2), message(5)), {QUEUE: mine()})
    notifies.broken.clear()
    # One retry_due() call: 2's callback raises again (DEAD: two attempts),
    # 5 runs and its callbacks run.
    tally = retry_due(mine(), now=timezone.now() + LATER)
    assert (tally.handled, tally.dead) == (1, 1)
    parked = InboxMessage.objects.get(state=InboxState.DEAD)
    assert (parked.attempts, parked.last_error) == (2, "the callback of order 2 failed")
    assert ran_for(notifies, 2) == [1, "second", "audit", 2, "second"]
    assert ran_for(notifies, 5) == ["audit", 2, "second"]


def test_a_robust_callback_that_raises_is_logged_and_its_message_handled(
    consumer, caplog
):
    @consumer(OrderPlaced, name="robust")
    def robust(event, context):
        transaction.on_commit(lambda: 1 / 0, robust=True)

    # Left to Django (only robust callbacks), which logs its error.
    with caplog.at_level(logging.ERROR):
        assert receive(message(1), QUEUE, mine()).handled == 1
    assert InboxMessage.objects.get().state == InboxState.HANDLED
    assert "ZeroDivisionError" in caplog.text


def test_inside_a_callers_transaction_the_callbacks_wait_for_its_commit(notifies):
    """receive() called inside the caller's own transaction: the callbacks
    run at that transaction's commit (Django's), not before."""
    with transaction.atomic():
        receive(message(1), QUEUE, mine())
        assert notifies.ran == []
    assert ran_for(notifies, 1) == [1, "second", "audit"]
