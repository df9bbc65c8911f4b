"""Recorded consumers (ConsumerSubscription): a ``consume`` process never
acknowledges as ignored a message that a consumer recorded by another
version of the code receives; it keeps it as that consumer's inbox row.
Retiring a consumer is explicit (``manage.py outbox_subscribers``). The
two-process version against real RabbitMQ is in tests/brokers/test_inbox.py."""

from __future__ import annotations

import datetime
import io
import re

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from outbox_app import InboxMessage
from outbox_app.exceptions import SubscriptionInUse
from outbox_app.inbox import Consumer, receive, receive_batch, retry_due
from outbox_app.inbox.recorded import record
from outbox_app.models import ConsumerSubscription
from outbox_app.store.lifecycle import INBOX, InboxState
from tests.inbox.conftest import QUEUE, batch_of, message, mine
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def effect(event, context):
    SideEffect.objects.create(
        handler=context.consumer,
        event_id=context.event_id,
        position=context.payload["order_id"],
    )


#: The new code's consumer: another process has it, this one does not (yet).
BILLING = Consumer(
    name="billing",
    fn=effect,
    event_types=frozenset({"OrderPlaced", "ParcelSent"}),
    queue=QUEUE,
)


def recorded_elsewhere(*consumers: Consumer, seconds_ago: float = 0) -> None:
    """A ``consume`` process of the new code recorded ``consumers``."""
    now = timezone.now() - datetime.timedelta(seconds=seconds_ago)
    ConsumerSubscription.objects.record(consumers, "new-host:1", now)


def kept_for(name: str) -> list[InboxMessage]:
    return list(InboxMessage.objects.filter(consumer=name).order_by("id"))


@pytest.fixture
def old_code(consumer):
    """This process: ``shipping`` only (the old code)."""

    @consumer(OrderPlaced, name="shipping")
    def shipping(event, context):
        effect(event, context)

    record(mine(), "default")
    return shipping


def test_a_message_only_a_recorded_consumer_receives_is_kept_for_it(old_code):
    recorded_elsewhere(BILLING)
    parcel = message(7, event_type="ParcelSent", payload={"order_id": 7})
    tally = receive_batch(batch_of(message(1), parcel), {QUEUE: mine()})
    # shipping ran on OrderPlaced; billing's two messages are kept for it.
    assert (tally.handled, tally.deferred, tally.ignored) == (1, 2, 0)
    rows = kept_for("billing")
    assert [r.event_type for r in rows] == ["OrderPlaced", "ParcelSent"]
    for row in rows:
        assert (row.state, row.attempts) == (InboxState.FAILED, 0)
        assert row.next_retry_at <= timezone.now() and row.body
        assert "kept for the consumer billing" in row.last_error
    # Redelivered: duplicates. Message by message: the same.
    assert receive_batch(batch_of(parcel), {QUEUE: mine()}).duplicates == 1
    assert receive(message(2), QUEUE, mine()).deferred == 1
    # This process has no billing: it never runs them.
    assert retry_due(mine()).handled == 0
    # A process of the new code does, from the database.
    assert retry_due([BILLING]).handled == 3
    assert sorted(
        SideEffect.objects.filter(handler="billing").values_list("position", flat=True)
    ) == [1, 2, 7]
    assert all(r.state == InboxState.HANDLED for r in kept_for("billing"))


def test_a_type_only_the_new_version_of_a_consumer_receives_waits_for_it(consumer):
    """This process has ``billing`` without ParcelSent (the old version of
    it): a ParcelSent is kept for ``billing``, and only a process whose
    ``billing`` receives ParcelSent runs it."""
    consumer(OrderPlaced, name="billing")(effect)
    recorded_elsewhere(BILLING)
    record(mine(), "default")
    parcel = message(7, event_type="ParcelSent", payload={"order_id": 7})
    assert receive(parcel, QUEUE, mine()).deferred == 1
    assert retry_due(mine()).handled == 0
    assert retry_due([BILLING]).handled == 1


def test_a_retired_consumer_is_no_longer_kept_for(old_code):
    recorded_elsewhere(BILLING, seconds_ago=3600)
    receive(message(1), QUEUE, mine())
    out = io.StringIO()
    call_command(
        "outbox_subscribers", "--retire", "billing", "--waiting", "skip", stdout=out
    )
    assert "Retired 2 consumer subscriptions of billing; 1 waiting" in out.getvalue()
    [row] = kept_for("billing")
    assert row.state == InboxState.DEAD  # requeueable from the admin
    tally = receive(message(2, event_type="ParcelSent"), QUEUE, mine())
    assert (tally.ignored, tally.deferred) == (1, 0)
    call_command("outbox_subscribers", "--reactivate", "billing", stdout=out)
    assert "Reactivated 2 consumer subscriptions of billing" in out.getvalue()
    assert receive(message(3), QUEUE, mine()).deferred == 1


def test_retiring_a_consumer_follows_the_rule_a_subscriptions_retire_follows(
    old_code,
):
    """One operation retires consumers and relays' subscriptions alike: it
    refuses rows a running process refreshed (naming them) unless forced,
    retires them, and gives up what waits for them by their lifecycle
    table's retire transition (an inbox message: DEAD)."""
    recorded_elsewhere(BILLING)  # a consume process that has it runs now
    receive(message(1), QUEUE, mine())  # kept for billing: FAILED
    rows = ConsumerSubscription.objects.filter(consumer="billing")
    with pytest.raises(ValueError, match="waiting must be one of"):
        rows.retire_and_settle(waiting="drop", by="t")
    with pytest.raises(SubscriptionInUse, match=f"billing <- OrderPlaced on {QUEUE}"):
        rows.retire_and_settle(waiting="skip", by="t")
    assert not rows.filter(retired_at__isnull=False).exists()
    assert rows.retire_and_settle(waiting="skip", by="t", force=True) == (2, 1)
    [retire] = [t for t in INBOX if t.by == "retire"]
    [row] = kept_for("billing")
    assert (row.state, row.next_retry_at) == (InboxState.DEAD, None)
    assert row.state in retire.targets
    assert set(rows.values_list("retired_by", flat=True)) == {"t"}


def test_the_subscribers_command_lists_records_and_guards_consumers(
    old_code, admin_client
):
    recorded_elsewhere(BILLING, seconds_ago=3600)
    receive(message(1), QUEUE, mine())
    out = io.StringIO()
    call_command("outbox_subscribers", stdout=out)
    listing = out.getvalue()
    assert "billing" in listing and "UNSERVED" in listing
    assert f"consumer on {QUEUE}" in listing
    [shipping] = [line for line in listing.splitlines() if "shipping" in line]
    assert " serving " in shipping  # a consume process refreshed it just now
    with pytest.raises(CommandError, match="a running consume process refreshes it"):
        call_command("outbox_subscribers", "--retire", "shipping", "--waiting", "keep")
    page = admin_client.get("/admin/outbox_app/consumersubscription/?served=unserved")
    assert page.context["cl"].result_count == 2  # billing's two types
    ConsumerSubscription.objects.all().delete()
    call_command("outbox_subscribers", "--record", stdout=out)
    assert ConsumerSubscription.objects.filter(consumer="shipping").exists()
    # Right after --record no consume process need be running: the refusal
    # says who refreshed it and when, not that a consume process has it.
    with pytest.raises(CommandError) as refused:
        call_command("outbox_subscribers", "--retire", "shipping", "--waiting", "keep")
    assert re.search(
        rf"shipping <- \S+ on {QUEUE} was refreshed \d+ s ago by outbox_subscribers ",
        str(refused.value),
    ), refused.value
    assert "still has" not in str(refused.value)
