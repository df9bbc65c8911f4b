"""outbox_app.ops.purge and ``manage.py outbox_purge``: only finished rows older than
the retention go."""

from __future__ import annotations

import datetime
import io
import time
import types

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from outbox_app import Delivery, OutboxEvent, outbox_action
from outbox_app.ops.purge import PurgeCounts, purge
from outbox_app.store.lifecycle import State
from tests.ops.factories import (
    age_events,
    delivery,
    events,
    mark_delivered,
    subscribed,
)

# The world below is row delivery's rows, written by hand; stream delivery's
# purge (events every cursor read) is tested in tests/delivery/test_stream.py.
pytestmark = [pytest.mark.django_db, pytest.mark.engine("rows")]

OLD = datetime.timedelta(days=40)
RECENT = datetime.timedelta(days=2)


@pytest.fixture
def world():
    """Every kind of row, old (40 days) and recent (2 days)."""
    rows = {}
    # Old, every delivery succeeded long ago: the event and its rows go.
    rows["finished"] = events(1)[0]
    delivery(rows["finished"], "a", State.SUCCEEDED, age=OLD)
    delivery(rows["finished"], "b", State.SUCCEEDED, age=OLD)
    # Old event with one old success and one unfinished delivery of each kind:
    # the event and the unfinished rows stay, the old success goes.
    for state in (State.PENDING, State.RUNNING, State.FAILED, State.DEAD):
        event = events(1)[0]
        rows[state] = event
        delivery(event, "a", State.SUCCEEDED, age=OLD)
        delivery(event, "b", state, age=OLD)
    # Old event whose last delivery succeeded recently (a requeue): stays whole.
    rows["recent_success"] = events(1)[0]
    delivery(rows["recent_success"], "a", State.SUCCEEDED, age=OLD)
    delivery(rows["recent_success"], "b", State.SUCCEEDED, age=RECENT)
    # Recent event, finished: stays.
    rows["recent"] = events(1)[0]
    delivery(rows["recent"], "a", State.SUCCEEDED, age=RECENT)
    old_events = [rows[k] for k in rows if k != "recent"]
    mark_delivered(*rows.values())
    # Old event never fanned out (nobody subscribes yet): stays.
    rows["awaiting"] = events(1, event_type="NobodyYet")[0]
    old_events.append(rows["awaiting"])
    # Sentinels: the old one goes, the recent one stays.
    for key in ("old_sentinel", "recent_sentinel"):
        with transaction.atomic(), outbox_action("Nothing"):
            pass
        rows[key] = OutboxEvent.objects.sentinels().order_by("-id").first()
    old_events.append(rows["old_sentinel"])
    age_events(old_events, OLD)
    age_events([rows["recent"], rows["recent_sentinel"]], RECENT)
    return rows


def remaining_events() -> set:
    return set(OutboxEvent.objects.values_list("pk", flat=True))


def test_purge__deletes_only_finished_rows_older_than_the_retention(world):
    before = Delivery.objects.count()

    counts = purge(batch_size=2)

    assert counts == PurgeCounts(events=1, deliveries=7, sentinels=1)
    assert Delivery.objects.count() == before - 7
    gone = {world["finished"].pk, world["old_sentinel"].pk}
    assert remaining_events() == {row.pk for row in world.values()} - gone
    # Every unfinished delivery is still there, whatever its age.
    for state in (State.PENDING, State.RUNNING, State.FAILED, State.DEAD):
        assert Delivery.objects.filter(event=world[state], state=state).exists()
        assert not Delivery.objects.filter(
            event=world[state], state=State.SUCCEEDED
        ).exists()
    assert Delivery.objects.filter(event=world["recent_success"]).count() == 1
    assert Delivery.objects.filter(event=world["recent"]).count() == 1
    # Running it again finds nothing.
    assert purge() == PurgeCounts()


def test_purge__dry_run_counts_the_same_and_deletes_nothing(world):
    before = (OutboxEvent.objects.count(), Delivery.objects.count())
    counts = purge(dry_run=True)
    assert counts == PurgeCounts(events=1, deliveries=7, sentinels=1)
    assert (OutboxEvent.objects.count(), Delivery.objects.count()) == before


def test_purge__older_than_and_the_retention_setting(world):
    # Nothing is older than 60 days.
    assert purge(60, dry_run=True) == PurgeCounts()
    with override_settings(OUTBOX_RETENTION_DAYS=60):
        assert purge(dry_run=True) == PurgeCounts()
    # With 1 day, the recent finished rows qualify too.
    counts = purge(1, dry_run=True)
    assert counts.events == 3  # finished, recent_success, recent
    assert counts.sentinels == 2


def test_purge__reports_progress(world):
    seen = []
    purge(batch_size=1, progress=lambda done, expected: seen.append(done.total))
    assert seen[0] == 0
    assert seen[-1] == 9
    assert seen == sorted(seen)


def test_purge__refuses_bad_arguments():
    with pytest.raises(ValueError, match="older_than_days"):
        purge(-1)
    with pytest.raises(ValueError, match="batch_size"):
        purge(batch_size=0)
    with pytest.raises(ValueError, match="pause_ratio"):
        purge(pause_ratio=-1)
    with pytest.raises(ValueError, match="busy_pause_ratio"):
        purge(busy_pause_ratio=-1)


def no_sleep(monkeypatch, slept: list) -> None:
    """The purge's pauses are recorded in ``slept``, not slept; the module's
    own ``time`` only (the process's ``time.sleep`` is left alone)."""
    from outbox_app.ops import purge as module

    clock = types.SimpleNamespace(monotonic=time.monotonic, sleep=slept.append)
    monkeypatch.setattr(module, "time", clock)


def test_purge__pauses_after_each_batch_as_long_as_told(world, monkeypatch):
    slept = []
    no_sleep(monkeypatch, slept)
    counts = purge(batch_size=1, pause_ratio=2)
    assert counts.total == 9
    assert slept and all(seconds >= 0 for seconds in slept)
    slept.clear()
    purge(batch_size=1, pause_ratio=0, busy_pause_ratio=0)  # no pause asked
    assert slept == []


def test_purge__yields_to_relays_with_work_waiting(monkeypatch):
    """While a delivery is due (or an event awaits fan-out) the purge
    sleeps ``busy_pause_ratio`` times a batch's duration, else ``pause_ratio``
    times; it looks at most once a second."""
    from outbox_app.ops.purge import _Pause

    slept = []
    no_sleep(monkeypatch, slept)
    event = events(1)[0]
    mark_delivered(event)
    row = delivery(event, "a", State.SUCCEEDED)
    _Pause("default", 1, 4)(0.01)
    assert slept == [pytest.approx(0.01)]
    Delivery.objects.filter(pk=row.pk).update(state=State.PENDING)
    pause = _Pause("default", 1, 4)
    pause(0.01)
    assert slept[-1] == pytest.approx(0.04)
    Delivery.objects.filter(pk=row.pk).update(state=State.SUCCEEDED)
    pause(0.01)  # within the second: still taken as busy
    assert slept[-1] == pytest.approx(0.04)
    slept.clear()
    _Pause("default", 0, 0)(0.01)
    assert slept == []


def test_purge__pages_do_not_lock_rows(world):
    # The ids are read without FOR UPDATE: only the DELETEs, by primary key,
    # lock rows, and only those rows.
    with CaptureQueriesContext(connection) as queries:
        purge(batch_size=2, pause_ratio=0)
    statements = [q["sql"] for q in queries.captured_queries]
    assert not [sql for sql in statements if "FOR UPDATE" in sql.upper()]
    assert [sql for sql in statements if sql.upper().startswith("DELETE")]


def test_command__purges_and_prints_a_summary(world):
    out = io.StringIO()
    call_command("outbox_purge", "--batch-size", "3", stdout=out)
    text = out.getvalue()
    assert "Deleted 1 event, 7 deliveries, 1 sentinel row and 0 inbox messages." in text
    assert "purged 9/9 rows (100%)" in text  # progress lines (not a terminal)
    assert not OutboxEvent.objects.filter(pk=world["finished"].pk).exists()


def test_command__dry_run(world):
    out = io.StringIO()
    call_command("outbox_purge", "--dry-run", "--older-than", "30", stdout=out)
    assert (
        "Would delete 1 event, 7 deliveries, 1 sentinel row and 0 inbox messages"
        in (out.getvalue())
    )
    assert OutboxEvent.objects.filter(pk=world["finished"].pk).exists()


def test_command__bad_arguments():
    with pytest.raises(CommandError, match="older-than"):
        call_command("outbox_purge", "--older-than", "-3")
    with pytest.raises(CommandError, match="batch-size"):
        call_command("outbox_purge", "--batch-size", "0")
    with pytest.raises(CommandError, match="pause-ratio"):
        call_command("outbox_purge", "--pause-ratio", "-1")


def test_command__pause_ratio(world):
    out = io.StringIO()
    call_command("outbox_purge", "--pause-ratio", "0", "-v", "0", stdout=out)
    assert "Deleted 1 event, 7 deliveries, 1 sentinel row and 0 inbox messages." in (
        out.getvalue()
    )


def test_purge__a_replay_between_its_read_and_its_delete_loses_nothing(monkeypatch):
    """A replay landing after the purge read its page of ids and before its
    DELETE: the DELETEs re-check the condition, so the replayed (PENDING) row
    and its event stay."""
    from outbox_app.ops import purge as purging
    from outbox_app.ops import subscriptions as operations

    [event] = events(1)
    row = delivery(event, "ops.record", State.SUCCEEDED, age=OLD)
    mark_delivered(event)
    age_events([event], OLD)
    atomic, replayed = purging.transaction.atomic, []

    def atomic_after_a_replay(*args, **kwargs):
        if not replayed:  # the page is read; its DELETEs come next
            replayed.append(True)  # (replay_to opens an atomic block too)
            with subscribed("OrderPlaced"):
                operations.replay_to(
                    OutboxEvent.objects.filter(pk=event.pk), "ops.record"
                )
        return atomic(*args, **kwargs)

    monkeypatch.setattr(purging.transaction, "atomic", atomic_after_a_replay)
    counts = purge(pause_ratio=0, busy_pause_ratio=0)
    assert replayed and counts.total == 0
    row.refresh_from_db()
    assert row.state == State.PENDING
    assert OutboxEvent.objects.filter(pk=event.pk).exists()
