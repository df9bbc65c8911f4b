"""outbox_app.ops.status and ``manage.py outbox_status``: numbers, JSON shape, exit
codes."""

from __future__ import annotations

import datetime
import io
import json
import re

import pytest
from django.core.management import ManagementUtility, call_command
from django.core.management.base import CommandError
from django.utils import timezone

from outbox_app.ops import status
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

pytestmark = pytest.mark.django_db

NOW = datetime.datetime(2025, 3, 1, 12, 30, 20, tzinfo=datetime.UTC)


def test_overview__counts_lag_expired_per_subscriber():
    first, second, third = events(3)
    delivery(first, "ops.record", State.PENDING, age=datetime.timedelta(minutes=5))
    delivery(second, "ops.record", State.FAILED, age=datetime.timedelta(minutes=2))
    delivery(third, "ops.record", State.DEAD)
    delivery(first, "gone.handler", State.PENDING, age=datetime.timedelta(hours=5))
    with subscribed("OrderPlaced"):
        data = status.overview()

    by_name = {row["name"]: row for row in data["subscribers"]}
    row = by_name["ops.record"]
    assert row["registered"] is True
    assert row["kind"] == "handler"
    assert row["states"] == {
        "PENDING": 1,
        "RUNNING": 0,
        "SUCCEEDED": 0,
        "FAILED": 1,
        "DEAD": 1,
        "SKIPPED": 0,
    }
    assert row["total"] == 3
    assert row["dead"] == 1
    assert 299 <= row["oldest_pending_seconds"] <= 330
    assert row["blocked_aggregates"] is None  # not ordered

    # Rows of a subscriber nobody registers are shown, but do not make the lag.
    orphan = by_name["gone.handler"]
    assert orphan["registered"] is False
    assert orphan["kind"] is None
    assert 299 <= data["lag_seconds"] <= 330

    assert data["dead"] == 1
    assert data["states"]["PENDING"] == 2
    json.dumps(data)  # plain JSON types only


def test_overview__blocked_aggregates_of_ordered_subscribers():
    a1, a2 = events(2, aggregate=("shop.Order", 1))
    (b1,) = events(1, aggregate=("shop.Order", 2))
    delivery(a1, "ops.ordered", State.DEAD)
    delivery(a2, "ops.ordered", State.PENDING)
    delivery(b1, "ops.ordered", State.DEAD)
    delivery(b1, "ops.record", State.DEAD)
    with (
        subscribed("OrderPlaced", name="ops.ordered", ordered=True),
        subscribed("OrderPlaced"),
    ):
        data = status.overview()
    by_name = {row["name"]: row for row in data["subscribers"]}
    assert by_name["ops.ordered"]["blocked_aggregates"] == 2
    assert by_name["ops.record"]["blocked_aggregates"] is None
    assert data["blocked_aggregates"] == 2


@pytest.mark.engine("rows")  # fan-out's lag; a stream's: test_stream.py
def test_overview__undelivered_events_and_fan_out_lag():
    old = events(1)
    events(1, event_type="NobodyListens")
    from outbox_app.models import OutboxEvent

    OutboxEvent.objects.filter(pk=old[0].pk).update(
        created_at=timezone.now() - datetime.timedelta(minutes=10)
    )
    assert status.overview()["oldest_awaiting_fanout_seconds"] is None  # no subscriber
    with subscribed("OrderPlaced"):
        data = status.overview()
    assert data["events_awaiting_fanout"] == 2
    assert 599 <= data["oldest_awaiting_fanout_seconds"] <= 630
    assert data["lag_seconds"] == data["oldest_awaiting_fanout_seconds"]


def test_deliveries_per_minute__buckets_by_utc_minute():
    event = events(1)[0]
    minute = datetime.timedelta(minutes=1)
    for subscriber, completed in [
        ("a", NOW),  # the current, partial minute: the last bucket
        ("b", NOW.replace(second=0)),
        ("c", NOW - minute),
        ("d", NOW - 3 * minute),
        ("e", NOW - 24 * 60 * minute),  # more than 24 h ago: left out
    ]:
        delivery(event, subscriber, State.SUCCEEDED, completed_at=completed)
    delivery(event, "f", State.DEAD, completed_at=NOW)  # not a delivery

    data = status.deliveries_per_minute(now=NOW)

    assert data["minutes"] == len(data["per_minute"]) == 24 * 60
    assert data["end"] == "2025-03-01T12:31:00+00:00"
    assert data["start"] == "2025-02-28T12:31:00+00:00"
    assert data["per_minute"][-1] == 2
    assert data["per_minute"][-2] == 1
    assert data["per_minute"][-3] == 0
    assert data["per_minute"][-4] == 1
    assert data["total"] == 4
    assert data["peak"] == 2


def test_problems__thresholds():
    data = {"lag_seconds": 120.0, "dead": 3}
    assert status.problems(data) == []
    assert status.problems(data, max_lag=120, max_dead=3) == []
    assert len(status.problems(data, max_lag=60, max_dead=2)) == 2
    assert status.problems({"lag_seconds": None, "dead": 0}, max_lag=0) == []


# --- the command ----------------------------------------------------------------------


def run(*args: str) -> tuple[str, int]:
    out = io.StringIO()
    try:
        call_command("outbox_status", *args, stdout=out)
    except CommandError as exc:
        return out.getvalue(), exc.returncode
    return out.getvalue(), 0


def test_command__table_and_exit_zero_when_healthy():
    event = events(1)[0]
    delivery(event, "ops.record", State.SUCCEEDED)
    with subscribed("OrderPlaced"):
        out, code = run()
    assert code == 0
    assert "ops.record" in out
    assert "handler" in out
    assert "dead:                0" in out


def test_command__json_shape():
    event = events(1)[0]
    delivery(event, "ops.record", State.DEAD)
    with subscribed("OrderPlaced"):
        out, code = run("--json")
    assert code == 0
    data = json.loads(out)
    assert set(data) == {
        "generated_at",
        "paused",
        "paused_by_operator",
        "unserved",
        "lag_seconds",
        "states",
        "dead",
        "scheduled",
        "next_scheduled",
        "blocked_aggregates",
        "events_awaiting_fanout",
        "oldest_awaiting_fanout_seconds",
        "streams",
        "subscribers",
        "deliveries",
        "inbox",
        "problems",
    }
    assert data["problems"] == []
    row = next(r for r in data["subscribers"] if r["name"] == "ops.record")
    assert set(row) == {
        "name",
        "kind",
        "registered",
        "ordered",
        "stored_names",
        "states",
        "total",
        "dead",
        "oldest_pending_seconds",
        "blocked_aggregates",
        "scheduled",
        "next_scheduled",
        "stream",
        "paused",
    }
    assert row["paused"] is None
    assert set(data["deliveries"]) == {
        "start",
        "end",
        "minutes",
        "per_minute",
        "total",
        "peak",
    }


def test_command__max_dead_crossed_exits_2():
    event = events(1)[0]
    delivery(event, "ops.record", State.DEAD)
    delivery(event, "other", State.DEAD)
    assert run("--max-dead", "2")[1] == 0
    out, code = run("--max-dead", "1", "--json")
    assert code == 2
    assert json.loads(out)["problems"] == ["2 dead deliveries, more than --max-dead 1"]


def test_command__max_dead_inbox_counts_the_inbox_dead_letter():
    from outbox_app.models import InboxMessage
    from outbox_app.store.lifecycle import InboxState

    for n, state in enumerate([InboxState.DEAD, InboxState.DEAD, "HANDLED"]):
        InboxMessage.objects.create(consumer="billing", message_id=str(n), state=state)
    assert run("--max-dead-inbox", "2")[1] == 0
    out, code = run("--max-dead-inbox", "1", "--json")
    assert code == 2
    assert json.loads(out)["problems"] == [
        "2 dead inbox messages, more than --max-dead-inbox 1"
    ]


def test_command__max_lag_crossed_exits_2():
    event = events(1)[0]
    delivery(event, "ops.record", State.PENDING, age=datetime.timedelta(minutes=2))
    with subscribed("OrderPlaced"):
        assert run("--max-lag", "300")[1] == 0
        out, code = run("--max-lag", "60")
    assert code == 2
    assert "UNHEALTHY: lag" in out


def test_command__process_exit_status(capsys):
    """What cron and a Kubernetes probe see: the process's exit status."""
    event = events(1)[0]
    delivery(event, "ops.record", State.DEAD)
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", "outbox_status", "--max-dead", "0"]).execute()
    assert exited.value.code == 2
    assert "more than --max-dead 0" in capsys.readouterr().err


def test_command__negative_threshold_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exited:
        ManagementUtility(["manage.py", "outbox_status", "--max-lag", "-1"]).execute()
    assert exited.value.code == 2  # argparse's usage error
    assert "--max-lag" in capsys.readouterr().err


def pause(name: str, *, since: datetime.timedelta, probed: datetime.timedelta):
    """A relay's pause of ``name``: paused ``since`` ago, next probe ``probed``
    from now."""
    from outbox_app.models import SubscriberPause
    from outbox_app.relay.sending import Pause

    now = timezone.now()
    SubscriberPause.objects.record(
        name,
        Pause(now - since, now + probed, 4, "cannot connect to amqp://x//: refused"),
        None,
    )


def test_paused_publishers_are_shown_with_their_reason():
    pause("rabbitmq", since=datetime.timedelta(minutes=3), probed=datetime.timedelta(0))
    # A relay that stopped while paused leaves its row; it is not shown once
    # nobody has probed for a while.
    pause(
        "stale", since=datetime.timedelta(days=1), probed=-datetime.timedelta(hours=1)
    )
    out, code = run()
    assert code == 0
    # 180 s, and what the command itself took (seconds on a loaded machine).
    paused_for = re.search(r"PAUSED: rabbitmq for ([\d.]+)s", out)
    assert paused_for and 180 <= float(paused_for[1]) < 200, out
    assert "cannot connect to amqp://x//: refused" in out
    assert "stale" not in out
    [paused] = json.loads(run("--json")[0])["paused"]
    assert (paused["subscriber"], paused["probes"]) == ("rabbitmq", 4)
    assert paused["paused_seconds"] >= 180


def test_a_paused_publisher_is_shown_on_its_row():
    """The row of the subscriber whose deliveries wait says why: an outage of
    its destination (in the table's paused column too)."""
    delivery(events(1)[0], "rabbitmq", State.PENDING)
    pause("rabbitmq", since=datetime.timedelta(minutes=3), probed=datetime.timedelta(0))
    rows = status.overview()["subscribers"]
    row = next(r for r in rows if r["name"] == "rabbitmq")
    assert [r["name"] for r in rows if r["paused"]] == ["rabbitmq"]
    assert row["paused"]["cause"] == "outage"
    assert row["paused"]["reason"] == "cannot connect to amqp://x//: refused"
    assert row["paused"]["paused_seconds"] >= 180
    out, _ = run()
    (line,) = [r for r in out.splitlines() if r.startswith("rabbitmq ")]
    assert line.split()[-1] == "outage"


def test_a_resumed_publisher_is_not_shown():
    from outbox_app.models import SubscriberPause

    pause("rabbitmq", since=datetime.timedelta(minutes=3), probed=datetime.timedelta(0))
    SubscriberPause.objects.update(resumed_at=timezone.now())
    assert status.paused() == []


def test_command__a_malformed_broker_url_is_masked(settings):
    settings.OUTBOX_PUBLISHERS = {
        "rabbitmq": {"URL": "amqp://user:s3cret@host:notaport//"}
    }
    with pytest.raises(CommandError) as raised:
        call_command("outbox_status", stdout=io.StringIO())
    assert "s3cret" not in str(raised.value)
    assert "amqp://user:**@host:notaport//" in str(raised.value)


def test_the_former_flag_names_still_set_the_dead_letter_limits():
    delivery(events(1)[0], "ops.record", State.DEAD)
    out, code = run("--max-expired", "0", "--json")
    assert (code, json.loads(out)["problems"]) == (
        2,
        ["1 dead delivery, more than --max-dead 0"],
    )
    assert run("--max-parked", "0")[1] == 0
