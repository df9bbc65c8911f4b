"""The operator's transitions (DeliveryQuerySet.apply) and operations on a
subscriber (outbox_app.ops.subscriptions): requeue, retry, dead-letter,
replay, in batches."""

from __future__ import annotations

import datetime

import pytest
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, UnknownSubscriber
from outbox_app.exceptions import UnknownTransition
from outbox_app.ops import subscriptions as operations
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

pytestmark = pytest.mark.django_db


def test_apply__requeue_resets_failed_and_expired_keeps_the_error():
    event = events(1)[0]
    expired = delivery(event, "a", State.DEAD)
    failed = delivery(event, "b", State.FAILED)
    done = delivery(event, "c", State.SUCCEEDED)
    before = timezone.now()

    assert Delivery.objects.apply("requeue", batch_size=1) == 2

    for row in (expired, failed):
        row.refresh_from_db()
        assert row.state == State.PENDING
        assert row.attempts == 0
        assert row.completed_at is None
        assert before <= row.next_retry_at <= timezone.now()
        assert row.last_error == "broker down"  # kept as history
    done.refresh_from_db()
    assert done.state == State.SUCCEEDED


def test_apply__dry_run_counts_and_changes_nothing():
    event = events(1)[0]
    delivery(event, "a", State.DEAD)
    delivery(event, "b", State.PENDING)
    rows = Delivery.objects.all()
    assert rows.apply("requeue", dry_run=True) == 1
    assert rows.apply("dead_letter", dry_run=True) == 1
    assert Delivery.objects.filter(state=State.DEAD).count() == 1


def test_apply__unknown_transition_is_refused():
    with pytest.raises(UnknownTransition, match="unknown transition 'delete'"):
        Delivery.objects.apply("delete")
    with pytest.raises(UnknownTransition):
        Delivery.objects.affected("replay")  # the lifecycle's, not an operator's batch


def test_requeue_deliveries__only_the_given_events():
    first, second = events(2)
    a = delivery(first, "a", State.DEAD)
    b = delivery(second, "a", State.DEAD)
    count = Delivery.objects.of_events(
        OutboxEvent.objects.filter(pk=first.pk)
    ).requeue()
    assert count == 1
    a.refresh_from_db()
    b.refresh_from_db()
    assert (a.state, b.state) == (State.PENDING, State.DEAD)


def test_deliveries_matching__filters_and_aliases():
    event_a, event_b, event_c = events(3)
    old = timezone.now() - datetime.timedelta(days=3)
    match = delivery(event_a, "old.name", State.DEAD)
    delivery(event_b, "ops.record", State.DEAD, last_error_type="builtins.ValueError")
    delivery(event_c, "ops.record", State.FAILED, updated_at=old)
    with subscribed("OrderPlaced", aliases=["old.name"]):
        rows = operations.deliveries_matching(
            subscriber="ops.record",
            states=[State.DEAD],
            error_type="builtins.ConnectionError",
            since=timezone.now() - datetime.timedelta(days=1),
        )
        assert list(rows) == [match]
        every = operations.deliveries_matching(subscriber="ops.record")
        assert every.count() == 3
        with pytest.raises(UnknownSubscriber, match="known: .*ops.record"):
            operations.deliveries_matching(subscriber="nobody")
        with pytest.raises(UnknownSubscriber, match="did you mean 'ops.record'"):
            operations.deliveries_matching(subscriber="ops.recrod")


def test_replay_to__creates_resets_and_skips():
    fresh, done, running, other_type = (
        events(1)[0],
        events(1)[0],
        events(1)[0],
        events(1, event_type="Other")[0],
    )
    succeeded = delivery(done, "ops.record", State.SUCCEEDED)
    busy = delivery(running, "ops.record", State.RUNNING)
    with subscribed("OrderPlaced"):
        result = operations.replay_to(
            OutboxEvent.objects.all(), "ops.record", batch_size=2
        )
    assert (result.created, result.reset, result.skipped) == (1, 1, 2)
    assert result.queued == 2
    created = Delivery.objects.get(event=fresh)
    assert (created.subscriber, created.state, created.event_type) == (
        "ops.record",
        State.PENDING,
        "OrderPlaced",
    )
    succeeded.refresh_from_db()
    assert succeeded.state == State.PENDING
    assert succeeded.completed_at is None
    busy.refresh_from_db()
    assert busy.state == State.RUNNING
    assert not Delivery.objects.filter(event=other_type).exists()


def test_replay_to__an_alias_resets_the_row_stored_under_the_old_name():
    event = events(1)[0]
    old = delivery(event, "old.name", State.DEAD)
    with subscribed("OrderPlaced", aliases=["old.name"]):
        result = operations.replay_to(OutboxEvent.objects.all(), "ops.record")
    assert (result.created, result.reset) == (0, 1)
    old.refresh_from_db()
    assert old.state == State.PENDING
    assert Delivery.objects.count() == 1


def test_replay_to__unknown_subscriber():
    events(1)
    with pytest.raises(UnknownSubscriber):
        operations.replay_to(OutboxEvent.objects.all(), "nobody")
