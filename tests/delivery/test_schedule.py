"""Scheduled and expiring events (``publish(deliver_at=..., expires_at=...)``),
driven by the relay's controllable clock (``relay_once(now=...)``) on every
database."""

from __future__ import annotations

import datetime
import io
import re

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.exceptions import InvalidSchedule
from outbox_app.ops.subscriptions import replay_to
from outbox_app.relay import relay_once
from outbox_app.store.lifecycle import State
from tests import kit
from tests.testapp.events import Step

pytestmark = pytest.mark.django_db(transaction=True)

MINUTE = datetime.timedelta(minutes=1)


def step(position: int = 0, aggregate=("shop.Cart", "1"), **schedule) -> OutboxEvent:
    with transaction.atomic():
        [row] = publish(Step(position=position), aggregate=aggregate, **schedule)
    return row


@pytest.fixture
def seen(registered):
    """Positions delivered to an unordered and an ordered handler."""
    delivered: dict[str, list[int]] = {"any": [], "ordered": []}

    @registered(Step, name="any")
    def any_order(event, context):
        delivered["any"].append(event.position)

    @registered(Step, name="ordered", ordered=True)
    def in_order(event, context):
        delivered["ordered"].append(event.position)

    return delivered


def test_a_scheduled_event_is_delivered_when_due__not_before(seen):
    row = step(deliver_at=10 * MINUTE)
    now = timezone.now()
    report = relay_once()  # writes its rows, due then; delivers nothing
    assert report.claimed == 0
    rows = Delivery.objects.filter(event=row)
    assert {(n.state, n.attempts) for n in rows} == {(State.PENDING, 0)}
    assert {n.next_retry_at for n in rows} == {row.deliver_at}
    assert {n.deliver_at for n in rows} == {row.deliver_at}

    assert relay_once(now=now + 9 * MINUTE).claimed == 0
    assert seen == {"any": [], "ordered": []}
    report = relay_once(now=now + 10 * MINUTE + datetime.timedelta(seconds=1))
    assert report.succeeded == 2
    assert seen == {"any": [0], "ordered": [0]}


def test_deliver_at_already_past_means_at_once(seen):
    row = step(deliver_at=timezone.now() - MINUTE)
    assert row.deliver_at is None
    assert OutboxEvent.objects.get(id=row.id).deliver_at is None
    assert relay_once().succeeded == 2


def test_scheduled_events_due_first_are_claimed_first(seen):
    """Rows are claimed by due time: the claim's index (subscriber,
    next_retry_at, id) orders scheduled rows by their deliver_at."""
    step(0, ("shop.Cart", "a"), deliver_at=3 * MINUTE)
    step(1, ("shop.Cart", "b"), deliver_at=1 * MINUTE)
    step(2, ("shop.Cart", "c"), deliver_at=2 * MINUTE)
    relay_once()
    relay_once(now=timezone.now() + 5 * MINUTE, batch_size=1)
    assert seen["any"] == [1, 2, 0]


def test_an_event_not_delivered_by_expires_at_is_skipped_with_the_reason(seen):
    kept = step(0, ("shop.Cart", "1"), expires_at=10 * MINUTE)
    assert relay_once().succeeded == 2  # delivered in time: delivered
    lapsed = step(1, ("shop.Cart", "2"), expires_at=MINUTE)
    report = relay_once(now=timezone.now() + 2 * MINUTE)
    assert (report.lapsed, report.succeeded, report.failed) == (2, 0, 0)
    assert seen == {"any": [0], "ordered": [0]}
    rows = list(Delivery.objects.filter(event=lapsed))
    assert {n.state for n in rows} == {State.SKIPPED}
    assert {n.attempts for n in rows} == {0}
    assert {n.last_error_type for n in rows} == {"outbox_app.exceptions.EventExpired"}
    assert all("expires_at" in n.last_error and n.completed_at for n in rows)
    assert all(n.lease_token is None for n in rows)
    assert kit.states(events=[kept]) == {State.SUCCEEDED: 2}
    assert relay_once(now=timezone.now() + 3 * MINUTE).claimed == 0


def test_a_failing_delivery_is_not_retried_past_expires_at(registered):
    calls = []

    @registered(Step, name="flaky")
    def flaky(event, context):
        calls.append(context.attempt)
        raise RuntimeError("down")

    row = step(expires_at=5 * MINUTE)
    assert relay_once().failed == 1
    report = relay_once(now=timezone.now() + 10 * MINUTE)
    assert (report.lapsed, report.failed) == (1, 0)
    assert calls == [1]
    delivery = Delivery.objects.get(event=row)
    assert delivery.state == State.SKIPPED
    assert delivery.attempts == 1  # the failed one; the lapse counted none
    assert delivery.first_failed_at is not None


def test_an_ordered_subscriber_waits_for_a_scheduled_head(seen):
    step(0, deliver_at=10 * MINUTE)
    step(1)
    relay_once()
    assert seen == {"any": [1], "ordered": []}  # held behind position 0
    relay_once(now=timezone.now() + 11 * MINUTE)
    assert seen["ordered"] == [0, 1]


def test_an_expired_head_does_not_block_its_aggregate(seen):
    step(0, deliver_at=MINUTE, expires_at=2 * MINUTE)
    step(1)
    step(2)
    relay_once()
    assert seen["ordered"] == []
    report = relay_once(now=timezone.now() + 3 * MINUTE)
    assert report.lapsed == 2  # position 0, to both handlers
    assert seen["ordered"] == [1, 2]
    assert sorted(seen["any"]) == [1, 2]


def test_bad_schedules_are_refused_and_nothing_is_written():
    now = timezone.now()
    naive = datetime.datetime(2030, 1, 1)
    cases = [
        ({"deliver_at": naive}, "aware"),
        ({"expires_at": naive}, "aware"),
        ({"deliver_at": 60}, "timedelta"),
        ({"expires_at": "tomorrow"}, "timedelta"),
        ({"expires_at": now - MINUTE}, "not after now"),
        ({"deliver_at": 5 * MINUTE, "expires_at": 5 * MINUTE}, "not after deliver_at"),
        ({"deliver_at": now + 5 * MINUTE, "expires_at": now + MINUTE}, "never"),
    ]
    for schedule, words in cases:
        with pytest.raises(InvalidSchedule, match=words), transaction.atomic():
            publish(Step(position=0), **schedule)
    assert not OutboxEvent.objects.exists()
    assert issubclass(InvalidSchedule, ValueError)


def test_one_publish_schedules_all_its_events():
    with transaction.atomic():
        rows = publish(
            Step(position=0), Step(position=1), deliver_at=MINUTE, expires_at=2 * MINUTE
        )
    stored = OutboxEvent.objects.filter(id__in=[r.id for r in rows])
    assert {(e.deliver_at, e.expires_at) for e in stored} == {
        (rows[0].deliver_at, rows[0].expires_at)
    }
    assert rows[0].expires_at - rows[0].deliver_at == MINUTE


def test_replay_leaves_a_scheduled_row_due_when_scheduled(seen):
    row = step(deliver_at=10 * MINUTE)
    relay_once()
    assert replay_to(OutboxEvent.objects.filter(id=row.id), "any").reset == 0
    assert relay_once().claimed == 0
    assert set(
        Delivery.objects.filter(event=row).values_list("next_retry_at", flat=True)
    ) == {row.deliver_at}


def test_replay_to_a_new_subscriber_keeps_the_schedule(registered):
    row = step(deliver_at=10 * MINUTE)
    relay_once()  # no subscriber yet: fanned out to none

    @registered(Step, name="late")
    def late(event, context):
        pass

    assert replay_to(OutboxEvent.objects.filter(id=row.id), "late").created == 1
    delivery = Delivery.objects.get(event=row, subscriber="late")
    assert delivery.next_retry_at == row.deliver_at
    assert delivery.deliver_at == row.deliver_at
    assert relay_once().claimed == 0


def test_status_counts_scheduled_deliveries_apart_from_lag(seen, client, admin_user):
    import json

    from django.core.management import call_command

    from outbox_app.ops.status import overview

    step(0, ("shop.Cart", "1"), deliver_at=10 * MINUTE)
    late = step(1, ("shop.Cart", "2"), deliver_at=MINUTE)
    relay_once()
    data = overview()
    assert data["scheduled"] == 4  # two events, two handlers
    assert data["lag_seconds"] is None  # scheduled rows wait on purpose
    assert data["next_scheduled"] == late.deliver_at.isoformat()
    row = next(r for r in data["subscribers"] if r["name"] == "any")
    assert (row["scheduled"], row["oldest_pending_seconds"]) == (2, None)

    # Once due, a row is late from its deliver_at, not from its fan-out.
    data = overview(now=late.deliver_at + datetime.timedelta(seconds=30))
    assert data["scheduled"] == 2
    assert data["lag_seconds"] == 30.0

    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "scheduled:           4 (pending, not due yet; next at" in out.getvalue()
    out = io.StringIO()
    call_command("outbox_status", "--json", stdout=out)
    assert json.loads(out.getvalue())["scheduled"] == 4

    client.force_login(admin_user)
    page = client.get("/admin/outbox_app/delivery/?schedule=scheduled")
    assert page.status_code == 200
    assert page.context["cl"].result_count == 4
    assert "scheduled, in" in page.content.decode()
    events = client.get("/admin/outbox_app/outboxevent/?schedule=scheduled")
    assert events.context["cl"].result_count == 2
    detail = client.get(f"/admin/outbox_app/outboxevent/{late.id}/change/")
    assert "Schedule" in detail.content.decode()
    overview_page = client.get("/admin/outbox_app/outboxoverview/")
    assert re.search(
        r'id="outbox-scheduled"><a href="[^"]*schedule=scheduled">4<',
        overview_page.content.decode(),
    )


def test_the_admin_shows_why_an_expired_event_was_skipped(seen, client, admin_user):
    row = step(expires_at=MINUTE)
    relay_once(now=timezone.now() + 2 * MINUTE)
    delivery = Delivery.objects.filter(event=row).first()
    client.force_login(admin_user)
    page = client.get(f"/admin/outbox_app/delivery/{delivery.id}/change/")
    html = page.content.decode()
    assert "EventExpired" in html
    assert "kept as history" not in html  # the reason it was skipped, current
    listing = client.get("/admin/outbox_app/outboxevent/?schedule=expiring")
    assert listing.context["cl"].result_count == 1
