"""A claimed batch is bounded in payload bytes (``OUTBOX_BATCH_BYTES``) as
well as in rows: every claim takes the prefix of its rows, in claim order,
whose payloads add up to the budget, and at least one row (a payload larger
than the budget goes alone)."""

from __future__ import annotations

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.relay import fan_out
from outbox_app.relay.batch import Batch, Fold
from outbox_app.relay.fanout import subscribed_types
from outbox_app.subscribers import Handler

pytestmark = pytest.mark.django_db(transaction=True)

PLAIN = Handler(name="bytes", event_types=frozenset({"Blob"}))
ORDERED = Handler(name="bytes.ordered", event_types=frozenset({"Blob"}), ordered=True)
#: Each payload below is 1,012 bytes of JSON: two fit in 2,100, three do not.
BUDGET = 2100


def blobs(*sizes: int, aggregate=None) -> list[OutboxEvent]:
    with transaction.atomic():
        return publish(
            *[
                {"event_type": "Blob", "payload": {"blob": "x" * (size - 12)}}
                for size in sizes
            ],
            aggregate=aggregate,
        )


def claim(subscriber, fold: Fold | None = None) -> list:
    batch = Batch.claim(subscriber, "default", 500, timezone.now(), "w", fold)
    return [c.event_id for c in batch.contexts]


@pytest.fixture
def budget(settings):
    settings.OUTBOX_BATCH_BYTES = BUDGET


def test_publish_stores_the_payload_size():
    (row,) = blobs(1012)
    assert OutboxEvent.objects.get(id=row.id).payload_bytes == 1012


@pytest.mark.engine("rows")
def test_a_claim_takes_the_prefix_within_the_budget(budget):
    events = [e.id for e in blobs(1012, 1012, 1012, 1012, 1012)]
    fan_out(subscribers=[PLAIN])
    assert Delivery.objects.filter(subscriber="bytes").count() == 5
    assert claim(PLAIN) == events[:2]
    assert claim(PLAIN) == events[2:4]
    assert claim(PLAIN) == events[4:]


@pytest.mark.engine("rows")
def test_a_payload_larger_than_the_budget_goes_alone(budget):
    events = [e.id for e in blobs(5000, 1012, 1012, 1012)]
    fan_out(subscribers=[PLAIN])
    assert claim(PLAIN) == events[:1]
    assert claim(PLAIN) == events[1:3]
    assert claim(PLAIN) == events[3:]


@pytest.mark.engine("rows")
def test_an_ordered_claim_takes_heads_within_the_budget(budget):
    heads = [blobs(1012, 1012, aggregate=("shop.Cart", str(n)))[0].id for n in range(3)]
    fan_out(subscribers=[ORDERED])
    assert claim(ORDERED) == heads[:2]
    assert claim(ORDERED) == heads[2:]


@pytest.mark.engine("rows")
def test_fan_out_folded_into_a_claim_stays_within_the_budget(budget):
    events = [e.id for e in blobs(1012, 1012, 1012)]
    fold = Fold(subscribed_types([PLAIN]))
    assert claim(PLAIN, fold) == events[:2]
    # The third is left for the next step, not fanned out meanwhile.
    assert OutboxEvent.objects.awaiting_fanout().count() == 1
    assert claim(PLAIN, fold) == events[2:]


@pytest.mark.engine("rows")
def test_due_rows_and_folded_fan_out_share_one_budget(budget):
    first = blobs(1012)[0].id
    fan_out(subscribers=[PLAIN])
    events = [e.id for e in blobs(1012, 1012)]
    fold = Fold(subscribed_types([PLAIN]))
    # The due row first, then fan-out tops the batch up to the budget only.
    assert claim(PLAIN, fold) == [first, events[0]]
    assert claim(PLAIN, fold) == events[1:]


@pytest.mark.engine("rows")
def test_an_oversized_event_is_fanned_out_and_claimed_alone(budget):
    events = [e.id for e in blobs(5000, 1012)]
    fold = Fold(subscribed_types([PLAIN]))
    assert claim(PLAIN, fold) == events[:1]
    assert claim(PLAIN, fold) == events[1:]


def test_one_relay_pass_drains_batches_cut_by_the_budget(budget, registered):
    """A batch the budget cut short counts as full: the relay claims again
    at once instead of taking it for the end of the backlog."""
    from outbox_app.relay import relay_once

    seen = []

    @registered("Blob", name="bytes.drain")
    def drain(event, context):
        seen.append(context.event_id)

    events = [e.id for e in blobs(*[1012] * 7)]
    report = relay_once()
    assert report.succeeded == 7 and sorted(seen) == sorted(events)
