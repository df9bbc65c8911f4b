"""deliver_now(): the handlers of captured events run in the test as the relay
runs them: savepoints, retry policy, on_commit callbacks, ordering, schedule
and expiry, events their handlers publish; failures reported, never
swallowed; no delivery row read or written."""

from __future__ import annotations

import datetime
import decimal
import logging
import time

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, publish
from outbox_app.exceptions import (
    CallTimeout,
    EndlessDelivery,
    HandlerFailed,
    TransactionBroken,
)
from outbox_app.relay import relay_once
from outbox_app.store.lifecycle import State
from outbox_app.testing import capture_events
from tests import kit
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db


def place(order_id: int, **options):
    with transaction.atomic():
        return publish(
            OrderPlaced(order_id=order_id, total=decimal.Decimal("9.90")),
            aggregate=("shop.Order", order_id),
            **options,
        )


def step(aggregate: str, position: int, **options):
    with transaction.atomic():
        publish(Step(position=position), aggregate=("shop.Order", aggregate), **options)


def effects(handler: str | None = None) -> list:
    rows = SideEffect.objects.order_by("pk")
    if handler:
        rows = rows.filter(handler=handler)
    return list(rows.values_list("handler", "position"))


def test_handlers_run_with_the_event_and_its_context(outbox, subscribe):
    seen = []

    @subscribe(OrderPlaced)
    def record(event, context):
        seen.append((event, context.attempt, context.subscriber, context.using))
        SideEffect.objects.create(handler="record", event_id=context.event_id)

    [row] = place(1)
    assert seen == []  # publishing runs nothing
    report = outbox.deliver_now()
    assert seen == [
        (
            OrderPlaced(order_id=1, total=decimal.Decimal("9.90")),
            1,
            "testing.record",
            "default",
        )
    ]
    [outcome] = report.succeeded
    assert (outcome.handler, outcome.attempts, outcome.captured.id) == (
        "testing.record",
        1,
        row.id,
    )
    assert SideEffect.objects.get().event_id == row.id
    # Delivered once: a second call has nothing left to do.
    assert outbox.deliver_now().outcomes == []
    assert len(seen) == 1
    # Nothing of the relay's tables was read or written: a relay would still
    # deliver the event once it commits.
    assert not Delivery.objects.exists()


def test_a_failing_handler_is_retried_then_raises_with_its_error(outbox, subscribe):
    @subscribe(OrderPlaced, max_attempts=3)
    def broken(event, context):
        SideEffect.objects.create(
            handler="broken", event_id=context.event_id, position=context.attempt
        )
        raise ValueError(f"no stock for order {event.order_id}")

    place(4)
    with pytest.raises(HandlerFailed) as failed:
        outbox.deliver_now()
    error = failed.value
    assert str(error).startswith(
        "deliver_now(): 1 of 1 deliveries went to the dead letter:\n"
        "  testing.broken: OrderPlaced "
    )
    assert "DEAD after 3 attempt(s): ValueError: no stock for order 4" in str(error)
    assert isinstance(error.__cause__, ValueError)  # its traceback is shown
    [outcome] = error.report.dead
    assert [str(e) for e in outcome.errors] == ["no stock for order 4"] * 3
    assert effects() == []  # each attempt's writes rolled back with its savepoint
    # DEAD is finished: not attempted again.
    assert outbox.deliver_now().outcomes == []


def test_the_report_instead_of_the_error(outbox, subscribe, caplog):
    class Flagged(Exception):
        pass

    calls = []

    @subscribe(OrderPlaced, give_up_on=[Flagged])
    def review(event, context):
        calls.append(context.attempt)
        raise Flagged("needs a review")

    place(1)
    report = outbox.deliver_now(raise_errors=False)
    [outcome] = report.dead
    assert (outcome.attempts, calls) == (1, [1])  # never retried
    assert type(outcome.error) is Flagged
    assert report.failures == [(outcome, outcome.error)]
    assert "testing.review: OrderPlaced" in str(report)
    assert "DEAD (attempt 1): needs a review" in caplog.text


def test_an_attempt_the_policy_retries_is_retried_at_once(outbox, subscribe, caplog):
    @subscribe(OrderPlaced)
    def flaky(event, context):
        SideEffect.objects.create(
            handler="flaky", event_id=context.event_id, position=context.attempt
        )
        if context.attempt < 3:
            raise ConnectionError(f"attempt {context.attempt} failed")

    place(1)
    with caplog.at_level(logging.WARNING, "outbox_app.testing"):
        report = outbox.deliver_now()
    [outcome] = report.succeeded
    assert outcome.attempts == 3
    assert [str(e) for _, e in report.failures] == [
        "attempt 1 failed",
        "attempt 2 failed",
    ]
    assert effects() == [("flaky", 3)]  # the failed attempts' writes rolled back
    assert caplog.text.count("failed, retried now") == 2


def test_errors_the_handler_did_not_raise_fail_the_attempt(outbox, subscribe):
    @subscribe(OrderPlaced, max_attempts=1)
    def swallows(event, context):
        try:
            with transaction.atomic():
                SideEffect.objects.create(handler="x", event_id=context.event_id)
                SideEffect.objects.create(handler="x", event_id=context.event_id)
        except Exception:
            transaction.set_rollback(True)  # returns, its transaction broken

    @subscribe(OrderPlaced, max_attempts=1, timeout=0.2)
    def slow(event, context):
        time.sleep(2)

    place(1)
    report = outbox.deliver_now(raise_errors=False)
    errors = {o.handler: type(o.error) for o in report.dead}
    assert errors == {
        "testing.swallows": TransactionBroken,
        "testing.slow": CallTimeout,
    }


def test_on_commit_callbacks_run_after_the_handler(outbox, subscribe):
    ran = []

    @subscribe(OrderPlaced, max_attempts=2)
    def notify(event, context):
        SideEffect.objects.create(
            handler=f"notify {context.attempt}",
            event_id=context.event_id,
            position=context.attempt,
        )
        transaction.on_commit(lambda: ran.append(("sent", context.attempt)))
        if context.attempt == 1:

            def fail():
                raise OSError("the mail server is down")

            transaction.on_commit(fail)

    place(1)
    report = outbox.deliver_now()
    # The first attempt's callback failed it (its writes were kept: the
    # relay had committed them); the second's ran.
    [outcome] = report.succeeded
    assert [str(e) for e in outcome.errors] == ["the mail server is down"]
    assert ran == [("sent", 1), ("sent", 2)]
    assert effects() == [("notify 1", 1), ("notify 2", 2)]


def test_events_the_handlers_publish_are_delivered_too(outbox, subscribe):
    @subscribe(OrderPlaced)
    def ship(event, context):
        step("ship", event.order_id)

    @subscribe(Step)
    def shipped(event, context):
        SideEffect.objects.create(
            handler="shipped", event_id=context.event_id, position=event.position
        )

    place(1)
    place(2)
    report = outbox.deliver_now()
    assert [o.handler for o in report.succeeded] == [
        "testing.ship",
        "testing.ship",
        "testing.shipped",
        "testing.shipped",
    ]
    assert effects() == [("shipped", 1), ("shipped", 2)]
    assert [c.event_type for c in outbox.events] == ["OrderPlaced"] * 2 + ["Step"] * 2


def test_events_a_failed_attempt_published_are_rolled_back(outbox, subscribe):
    @subscribe(OrderPlaced, max_attempts=1)
    def ship_then_fail(event, context):
        step("ship", 1)
        raise RuntimeError("after publishing")

    @subscribe(Step)
    def never(event, context):
        raise AssertionError("a rolled-back event was delivered")

    place(1)
    report = outbox.deliver_now(raise_errors=False)
    assert [o.handler for o in report.outcomes] == ["testing.ship_then_fail"]
    assert [c.event_type for c in outbox.rolled_back] == ["Step"]


def test_a_handler_that_publishes_what_it_handles_is_stopped(outbox, subscribe):
    @subscribe(Step)
    def again(event, context):
        step("loop", event.position + 1)

    step("loop", 0)
    with pytest.raises(EndlessDelivery, match="after 100 rounds"):
        outbox.deliver_now()


def test_rolled_back_and_uncaptured_events_are_not_delivered(subscribe):
    @subscribe(OrderPlaced)
    def record(event, context):
        SideEffect.objects.create(
            handler="record", event_id=context.event_id, position=event.order_id
        )

    place(1)  # not captured
    with capture_events() as outbox:
        place(2)
        try:
            with transaction.atomic():
                place(3)
                raise RuntimeError
        except RuntimeError:
            pass
    outbox.deliver_now()
    assert effects() == [("record", 2)]


def test_scheduled_and_expiring_events(outbox, subscribe):
    @subscribe(OrderPlaced)
    def record(event, context):
        SideEffect.objects.create(
            handler="record", event_id=context.event_id, position=event.order_id
        )

    now = timezone.now()
    place(1, deliver_at=datetime.timedelta(hours=1))
    place(2, expires_at=datetime.timedelta(minutes=5))
    report = outbox.deliver_now()
    assert [(o.captured.event.order_id, o.state) for o in report.outcomes] == [
        (1, "PENDING"),
        (2, "SUCCEEDED"),
    ]
    assert report.pending[0].reason.startswith("scheduled for ")
    place(3, expires_at=datetime.timedelta(minutes=5))
    report = outbox.deliver_now(at=now + datetime.timedelta(hours=2))
    assert [(o.captured.event.order_id, o.state) for o in report.outcomes] == [
        (1, "SUCCEEDED"),
        (3, "SKIPPED"),
    ]
    assert "expires_at" in report.skipped[0].reason
    assert effects() == [("record", 2), ("record", 1)]


def test_an_ordered_handler_holds_an_aggregate_behind_its_dead_letter(
    outbox, subscribe
):
    @subscribe(Step, ordered=True, max_attempts=1)
    def ordered(event, context):
        if event.position == 2:
            raise ValueError("step 2 is broken")
        SideEffect.objects.create(
            handler="ordered",
            event_id=context.event_id,
            position=event.position,
            aggregate=context.aggregate_id,
        )

    for position in (1, 2, 3):
        step("a", position)
        step("b", position + 10)
    report = outbox.deliver_now(raise_errors=False)
    assert [o.state for o in report.outcomes] == [
        "SUCCEEDED",
        "SUCCEEDED",
        "DEAD",
        "SUCCEEDED",
        "PENDING",
        "SUCCEEDED",
    ]
    assert report.pending[0].reason == (
        "held back behind an earlier event of its aggregate"
    )
    assert [position for _, position in effects()] == [1, 11, 12, 13]
    # Still held on the next call: the dead letter stays.
    assert [o.state for o in outbox.deliver_now(raise_errors=False).outcomes] == [
        "PENDING"
    ]


@pytest.mark.django_db(transaction=True)
def test_in_transactions_that_commit(outbox, subscribe):
    @subscribe(OrderPlaced)
    def record(event, context):
        SideEffect.objects.create(
            handler="record", event_id=context.event_id, position=context.attempt
        )
        transaction.on_commit(lambda: ran.append("robust"), robust=True)

    ran = []
    [row] = place(1)
    outbox.deliver_now()
    assert effects() == [("record", 1)]
    assert ran == ["robust"]  # Django ran it at the commit, as for the relay
    # The event is still the relay's to deliver: deliver_now wrote nothing
    # it reads (here its handler's write clashes with deliver_now's).
    SideEffect.objects.all().delete()
    assert relay_once().succeeded == 1
    assert effects() == [("record", 1)]
    assert kit.deliveries([row]) == {(row.id, "testing.record"): State.SUCCEEDED}
