"""Ordered delivery follows publish order, as the database numbered the
events on insert (``OutboxEvent.position``), whatever their ids and versions
say; and every aggregate an ordered subscriber is stuck on is counted."""

from __future__ import annotations

import pytest
from django.db import transaction

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.events.ids import new_event_id
from outbox_app.relay import relay_once
from outbox_app.store.lifecycle import State
from tests import kit
from tests.testapp.events import Step

pytestmark = pytest.mark.django_db(transaction=True)

CART = ("shop.Cart", "c")


def step(position: int, event_id) -> dict:
    return {"event_type": "Step", "payload": {"position": position}, "id": event_id}


def drain(times: int = 6) -> None:
    for _ in range(times):
        relay_once()


def test_versions_mixed_with_unversioned_events_are_delivered_in_publish_order(
    registered,
):
    """Ids from several hosts' clocks: id1 < id2 < id3. Published A (no
    version, id2), then B (version 5, id3), then C (version 6, id1). Under an
    order of "versions when both have one, else ids" the three formed a cycle
    (B < C by version, C < A by id, A < B by id): no head, nothing delivered,
    ever, and nothing counted as blocked."""
    seen = []

    @registered(Step, name="cycle", ordered=True)
    def cycle(event, context):
        seen.append(event.position)

    id1, id2, id3 = sorted(new_event_id() for _ in range(3))
    with transaction.atomic():
        publish(step(1, id2), aggregate=CART)
    with transaction.atomic():
        publish(step(2, id3), aggregate=CART, aggregate_version=5)
    with transaction.atomic():
        publish(step(3, id1), aggregate=CART, aggregate_version=6)
    drain()
    assert seen == [1, 2, 3]
    assert kit.states("cycle") == {State.SUCCEEDED: 3}


def test_ids_that_disagree_with_publish_order_are_delivered_in_publish_order(
    registered,
):
    seen = []

    @registered(Step, name="skewed", ordered=True)
    def skewed(event, context):
        seen.append(event.position)

    # Each event's id sorts before the previous one's (a host whose clock
    # is behind publishes next).
    ids = sorted((new_event_id() for _ in range(4)), reverse=True)
    for position, event_id in enumerate(ids):
        with transaction.atomic():
            publish(step(position, event_id), aggregate=CART)
    drain()
    assert seen == [0, 1, 2, 3]


def test_one_publish_numbers_its_events_in_argument_order():
    with transaction.atomic():
        rows = publish(
            *[Step(position=p) for p in range(3)], aggregate=CART, aggregate_version=1
        )
    with transaction.atomic():
        (later,) = publish(Step(position=3), aggregate=CART)
    positions = dict(OutboxEvent.objects.values_list("id", "position"))
    numbered = [positions[r.id] for r in [*rows, later]]
    assert None not in numbered and numbered == sorted(numbered)
    assert len(set(numbered)) == 4


def test_an_event_the_orm_inserts_is_numbered_too():
    """Rows written without publish() (the ORM, a data migration, raw SQL
    that leaves the column out) get a position from the database."""
    from django.utils import timezone

    with transaction.atomic():
        (first,) = publish(Step(position=0), aggregate=CART)
    now = timezone.now()
    made = OutboxEvent.objects.create(
        namespace="test",
        event_type="Step",
        aggregate_type=CART[0],
        aggregate_id=CART[1],
        payload={"position": 1},
        occurred_at=now,
        created_at=now,
        fanned_out=False,
    )
    OutboxEvent.objects.bulk_create(
        [
            OutboxEvent(
                namespace="test",
                event_type="Step",
                payload={"position": p},
                occurred_at=now,
                created_at=now,
                fanned_out=False,
            )
            for p in (2, 3)
        ]
    )
    positions = list(
        OutboxEvent.objects.order_by("position").values_list("payload", flat=True)
    )
    assert [p["position"] for p in positions] == [0, 1, 2, 3]
    assert OutboxEvent.objects.get(id=made.id).position > (
        OutboxEvent.objects.get(id=first.id).position
    )


def test_blocked_aggregates_counts_each_stuck_aggregate_once(registered, settings):
    """An aggregate held back by a DEAD row counts once, however many of
    its rows are DEAD or waiting behind it; events without an aggregate
    hold nothing back and are not counted."""
    settings.OUTBOX_MAX_ATTEMPTS = 1

    @registered(Step, name="stuck", ordered=True)
    def stuck(event, context):
        if event.position < 2:
            raise ValueError("poison")

    with transaction.atomic():
        for position in range(4):
            publish(Step(position=position), aggregate=("shop.Cart", "a"))
        publish(Step(position=0), aggregate=("shop.Cart", "b"))
        publish(Step(position=0), Step(position=1))  # no aggregate
    drain()
    rows = Delivery.objects.for_subscribers(["stuck"])
    assert rows.filter(state=State.DEAD).count() == 4  # a0, b0 and both loose
    # An operator expires what waits behind a's head: four DEAD rows, one
    # aggregate.
    assert rows.filter(aggregate_id="a", state=State.PENDING).dead_letter() == 3
    assert rows.blocked_aggregates() == 2  # a and b
    rows.filter(aggregate_id="b").skip()
    assert rows.blocked_aggregates() == 1


@pytest.mark.engine("rows")
def test_an_ordered_subscriber_claimed_before_the_fan_out_gets_its_event_that_turn(
    registered,
):
    """A turn visits subscribers in turn; the first unordered one fans the new
    events out as it claims, for every subscriber. An ordered subscriber
    visited before it found nothing yet: the same turn visits it again, so
    its event does not wait for the next wake-up (a poll, seconds away)."""
    from outbox_app.relay import deliver, registry

    seen = []

    @registered(Step, name="first.ordered", ordered=True)
    def first(event, context):
        seen.append("ordered")

    @registered(Step, name="then.unordered")
    def then(event, context):
        seen.append("unordered")

    with transaction.atomic():
        publish(step(1, new_event_id()), aggregate=CART)
    report = deliver([registry.get("first.ordered"), registry.get("then.unordered")])
    assert (report.fanned_out, report.succeeded) == (1, 2)
    assert sorted(seen) == ["ordered", "unordered"]
