"""``manage.py outbox_replay``: the admin's "Replay to subscriber…" from a
shell, over ``ops.subscriptions.replay_to``."""

from __future__ import annotations

import datetime
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent
from outbox_app.management.commands.outbox_replay import Command
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, mark_delivered, subscribed

pytestmark = pytest.mark.django_db


def replay(*args: str) -> str:
    out = io.StringIO()
    with subscribed("OrderPlaced"):
        call_command("outbox_replay", *args, stdout=out)
    return out.getvalue()


def states() -> dict[str, tuple[str, int]]:
    return {
        str(row.event_id): (row.state, row.attempts)
        for row in Delivery.objects.filter(subscriber="ops.record")
    }


def test_a_handler_deployed_later_gets_the_events_fanned_out_before_it():
    placed = events(3, aggregate=("shop.Order", "1"))
    other = events(1, event_type="OrderShipped")
    mark_delivered(*placed, *other)  # fanned out before the handler existed
    out = replay("ops.record", "--since", "2000-01-01")
    assert (
        "Replayed to ops.record: 3 deliveries are due now (3 new, 0 reset, "
        "1 skipped" in out
    )
    assert set(states().values()) == {(State.PENDING, 0)}
    assert set(states()) == {str(e.id) for e in placed}


def test_existing_deliveries_are_reset_whatever_their_state():
    done, dead, mine, theirs = events(4)
    delivery(done, "ops.record", State.SUCCEEDED)
    delivery(dead, "ops.record", State.DEAD)
    OutboxEvent.objects.filter(pk=theirs.pk).update(
        aggregate_type="shop.Order", aggregate_id="7"
    )
    OutboxEvent.objects.filter(pk__in=[done.pk, dead.pk]).update(
        aggregate_type="shop.Order", aggregate_id="7"
    )
    out = replay("ops.record", "--aggregate", "shop.Order:7")
    assert "3 deliveries are due now (1 new, 2 reset, 0 skipped" in out
    assert states() == {
        str(done.id): (State.PENDING, 0),
        str(dead.id): (State.PENDING, 0),
        str(theirs.id): (State.PENDING, 0),
    }
    assert str(mine.id) not in states()


def test_by_event_id_and_by_time():
    first, second = events(2)
    OutboxEvent.objects.filter(pk=first.pk).update(
        created_at=timezone.now() - datetime.timedelta(days=3)
    )
    replay("ops.record", "--event", str(second.id))
    assert set(states()) == {str(second.id)}
    yesterday = (timezone.now() - datetime.timedelta(days=1)).isoformat()
    replay("ops.record", "--until", yesterday)
    assert set(states()) == {str(first.id), str(second.id)}


def test_dry_run_counts_and_changes_nothing():
    events(2)
    events(1, event_type="OrderShipped")
    out = replay("ops.record", "--all", "--dry-run")
    assert "Would replay 2 events to ops.record (dry run: nothing changed)." in out
    assert states() == {}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["ops.record"], "select the events to replay"),
        (["nobody", "--all"], "nobody"),
        (["ops.record", "--aggregate", "shop.Order"], "TYPE:ID"),
        (["ops.record", "--event", "not-a-uuid"], "--event"),
        (["ops.record", "--since", "yesterday"], "invalid date value"),
    ],
)
def test_bad_input_is_a_clear_error_and_changes_nothing(args, message):
    events(1)
    with pytest.raises(CommandError, match=message):
        replay(*args)
    assert states() == {}


def test_help_explains_what_it_does():
    text = Command().create_parser("manage.py", "outbox_replay").format_help()
    for phrase in (
        "SUBSCRIBER",
        "created if it has",
        "put back to PENDING",
        "--event-type",
        "--aggregate TYPE:ID",
        "--all",
        "--dry-run",
    ):
        assert phrase in " ".join(text.split()), phrase
