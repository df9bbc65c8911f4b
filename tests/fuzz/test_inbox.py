"""The inbox's batch path against its message-by-message path (hypothesis):
for any batches of messages with duplicates, failing consumers and ordered
aggregates, ``receive_batch()`` leaves the same inbox rows, the same effects
and the same counts as ``receive()`` of each message in turn, and calls a
failing consumer as often."""

from __future__ import annotations

import uuid
from collections import Counter
from dataclasses import asdict

import pytest
from django.utils import timezone
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from outbox_app import InboxMessage
from outbox_app.inbox import Tally, receive, receive_batch
from outbox_app.inbox.registry import consumer, consumers, unregister_consumer
from outbox_app.publishers.cloudevents import body
from outbox_app.subscribers import DeliveryContext
from tests.kit import tried
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)

MESSAGES = 8  # message n: event id n + 1, aggregate n % 3
BATCHED, ALONE = "tests.fuzz.batched", "tests.fuzz.alone"
TRIED = tried(
    "fuzzed receive_batch()", {"examples": 0, "messages": 0, "failing": 0, "ordered": 0}
)


def message(n: int) -> bytes:
    return body(
        DeliveryContext(
            event_id=uuid.UUID(int=n + 1),
            namespace="shop",
            event_type="OrderPlaced",
            revision=1,
            payload={"order_id": n, "total": "1.00"},
            aggregate_type="shop.Order",
            aggregate_id=str(n % 3),
            aggregate_version=None,
            headers={},
            tenant_id=None,
            action_id=None,
            occurred_at=timezone.now(),
            attempt=1,
            subscriber="rabbitmq",
            delivery_id=n,
        )
    )


def outcome(name: str) -> tuple:
    """What ``name``'s consumer left: its inbox rows and its effects."""
    rows = sorted(
        InboxMessage.objects.filter(consumer=name).values_list(
            "message_id", "state", "attempts", "last_error"
        )
    )
    effects = sorted(
        SideEffect.objects.filter(handler=name).values_list("position", flat=True)
    )
    return rows, effects


@given(
    batches=st.lists(
        st.lists(st.integers(0, MESSAGES - 1), min_size=1, max_size=8),
        min_size=1,
        max_size=5,
    ),
    failing=st.sets(st.integers(0, MESSAGES - 1), max_size=3),
    ordered=st.booleans(),
)
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
def test_a_batch_as_one_equals_its_messages_one_at_a_time(batches, failing, ordered):
    InboxMessage.objects.all().delete()
    SideEffect.objects.all().delete()
    calls = Counter()

    def effect(event, context):
        calls[context.consumer, event.order_id] += 1
        SideEffect.objects.create(
            handler=context.consumer,
            event_id=context.event_id,
            position=event.order_id,
        )
        if event.order_id in failing:
            raise RuntimeError(f"order {event.order_id} fails")

    for name in (BATCHED, ALONE):
        consumer(OrderPlaced, queue=name, name=name, ordered=ordered)(effect)
    try:
        batched, alone = Tally(), Tally()
        for batch in batches:
            batched += receive_batch(
                [(message(n), BATCHED, None) for n in batch],
                {BATCHED: consumers([BATCHED])},
            )
            for n in batch:
                alone += receive(message(n), ALONE, consumers([ALONE]))
    finally:
        for name in (BATCHED, ALONE):
            unregister_consumer(name)
    assert asdict(batched) == asdict(alone)
    assert outcome(BATCHED) == outcome(ALONE)
    # A failing consumer is called once per attempt (the consumers before it
    # in its batch are called again, their first writes rolled back).
    for n in failing:
        assert calls[BATCHED, n] == calls[ALONE, n], n
    TRIED["examples"] += 1
    TRIED["messages"] += sum(map(len, batches))
    TRIED["failing"] += bool(failing)
    TRIED["ordered"] += ordered
