"""Persisted subscriptions: fan-out creates deliveries
for every subscriber some relay recorded, not only for the ones this process
has, so subscribers survive a rolling deploy; retiring one is an explicit act."""

from __future__ import annotations

import datetime
import io
import logging
import re
import signal
import time
import types

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent
from outbox_app.exceptions import SubscriptionInUse
from outbox_app.models import Subscription
from outbox_app.ops import status
from outbox_app.ops import subscriptions as operations
from outbox_app.relay import fan_out, relay_once
from outbox_app.relay.loop import HELD_REFRESH_SECONDS
from outbox_app.relay.registry import get
from outbox_app.store.lifecycle import State
from outbox_app.subscribers import Handler
from tests import kit
from tests.processes import spawn, wait_for
from tests.testapp.models import SideEffect

from .test_delivery import place

pytestmark = pytest.mark.django_db(transaction=True)

ELSEWHERE = Handler(name="elsewhere", event_types=frozenset({"OrderPlaced"}))


def record_elsewhere(seconds_ago: float = 0) -> None:
    """Another relay, which has the ``elsewhere`` handler, recorded it."""
    now = timezone.now() - datetime.timedelta(seconds=seconds_ago)
    Subscription.objects.record([ELSEWHERE], "other-host:1", now)


def states_of(name: str) -> list[str]:
    """The states of ``name``'s deliveries as an operator sees them (rows, or
    where its cursor stands), sorted."""
    return sorted(kit.states(name).elements())


def test_fan_out_reaches_a_subscriber_only_another_relay_has(handlers):
    handlers("record")
    record_elsewhere()
    place(5)
    report = relay_once()
    # This process delivers to its own subscribers only; the other relay's
    # deliveries wait for it.
    assert report.succeeded == 10
    assert states_of("elsewhere") == [State.PENDING] * 5
    assert SideEffect.objects.count() == 10
    recorded = set(
        Subscription.objects.active().values_list("subscriber", "event_type")
    )
    assert {
        ("record_a", "OrderPlaced"),
        ("record_b", "OrderPlaced"),
        ("elsewhere", "OrderPlaced"),
    } <= recorded


def test_the_relay_records_what_it_has_and_refreshes_it(handlers):
    handlers("record")
    fan_out()
    row = Subscription.objects.get(subscriber="record_a")
    assert (row.kind, row.ordered, row.retired_at) == ("handler", False, None)
    assert ":" in row.last_seen_by
    stale = timezone.now() - datetime.timedelta(hours=1)
    Subscription.objects.update(last_seen_at=stale)
    Subscription.objects.record([get("record_a")], "me:1")
    assert Subscription.objects.get(subscriber="record_a").last_seen_at > stale
    assert Subscription.objects.get(subscriber="record_b").last_seen_at == stale


def test_a_retired_subscription_gets_no_new_deliveries(handlers, caplog):
    handlers("record")
    place(2)
    relay_once()
    retired, skipped = operations.retire(
        Subscription.objects.filter(subscriber="record_b"),
        waiting="keep",
        by="test",
        force=True,
    )
    assert (retired, skipped) == (1, 0)
    place(3)
    with caplog.at_level(logging.WARNING, logger="outbox_app.relay"):
        relay_once()
    assert len(states_of("record_a")) == 5
    assert len(states_of("record_b")) == 2
    # A relay that still has it does not bring it back; it says so.
    assert Subscription.objects.get(subscriber="record_b").retired_by == "test"
    assert "record_b <- OrderPlaced is retired" in caplog.text
    operations.reactivate(Subscription.objects.filter(subscriber="record_b"))
    place(1)
    relay_once()
    # Reactivated, it receives what follows, not what was published meanwhile.
    effects = SideEffect.objects.filter(handler="record_b")
    assert effects.count() == 3


def test_a_renamed_subscriber_retires_its_former_name(registered):
    Subscription.objects.record(
        [Handler(name="old.name", event_types=frozenset({"OrderPlaced"}))], "old:1"
    )

    @registered("OrderPlaced", name="new.name", aliases=["old.name"])
    def renamed(event, context):
        pass

    place(2)
    relay_once()
    old = Subscription.objects.get(subscriber="old.name")
    assert old.retired_at is not None
    assert old.retired_by == "renamed to new.name"
    assert states_of("new.name") == [State.SUCCEEDED] * 2
    assert states_of("old.name") == []


def test_retire_refuses_a_subscription_a_running_relay_has(handlers):
    handlers("record")
    fan_out()
    with pytest.raises(SubscriptionInUse, match="record_a <- OrderPlaced"):
        operations.retire(
            Subscription.objects.filter(subscriber="record_a"), waiting="skip", by="t"
        )
    assert not Subscription.objects.filter(retired_at__isnull=False).exists()
    with pytest.raises(ValueError):
        operations.retire(Subscription.objects.all(), waiting="drop", by="t")


@pytest.mark.engine("rows")
def test_retire_skips_the_waiting_rows_or_keeps_them():
    record_elsewhere(seconds_ago=3600)
    events = place(5)
    fan_out(subscribers=[])  # another relay's fan-out: elsewhere's rows wait
    rows = Delivery.objects.filter(subscriber="elsewhere").order_by("id")
    ids = list(rows.values_list("id", flat=True))
    rows.filter(id=ids[1]).update(state=State.FAILED)
    rows.filter(id=ids[2]).update(state=State.DEAD)
    rows.filter(id=ids[3]).update(state=State.RUNNING)
    rows.filter(id=ids[4]).update(state=State.SUCCEEDED)
    retired, skipped = operations.retire(
        Subscription.objects.filter(subscriber="elsewhere"), waiting="skip", by="t"
    )
    assert (retired, skipped) == (1, 3)
    assert [rows.get(id=i).state for i in ids] == [
        State.SKIPPED,
        State.SKIPPED,
        State.SKIPPED,
        State.RUNNING,
        State.SUCCEEDED,
    ]
    assert len(events) == 5


def test_unserved_subscriptions_show_in_the_status(handlers):
    handlers("record")
    record_elsewhere(seconds_ago=3600)
    fan_out()
    data = status.overview()
    assert [(r["subscriber"], r["event_type"]) for r in data["unserved"]] == [
        ("elsewhere", "OrderPlaced")
    ]
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    assert "UNSERVED: elsewhere <- OrderPlaced (handler)" in out.getvalue()


def test_the_subscribers_command(handlers):
    handlers("record")
    record_elsewhere(seconds_ago=3600)
    place(2)
    fan_out()
    out = io.StringIO()
    call_command("outbox_subscribers", stdout=out)
    listing = out.getvalue()
    assert "elsewhere" in listing and "UNSERVED" in listing
    assert "record_a" in listing and "served" in listing
    with pytest.raises(CommandError, match="--waiting"):
        call_command("outbox_subscribers", "--retire", "elsewhere")
    with pytest.raises(CommandError, match="no subscription of 'nobody'"):
        call_command("outbox_subscribers", "--retire", "nobody", "--waiting", "keep")
    with pytest.raises(CommandError, match="a running relay refreshes it"):
        call_command("outbox_subscribers", "--retire", "record_a", "--waiting", "keep")
    out = io.StringIO()
    call_command(
        "outbox_subscribers", "--retire", "elsewhere", "--waiting", "skip", stdout=out
    )
    assert "Retired 1 subscriptions of elsewhere; 2 waiting" in out.getvalue()
    assert states_of("elsewhere") == [State.SKIPPED] * 2
    assert Subscription.objects.get(subscriber="elsewhere").retired_by == (
        "manage.py outbox_subscribers"
    )
    call_command("outbox_subscribers", "--reactivate", "elsewhere", stdout=out)
    assert Subscription.objects.get(subscriber="elsewhere").retired_at is None
    Subscription.objects.all().delete()
    call_command("outbox_subscribers", "--record", stdout=out)
    assert Subscription.objects.filter(subscriber="record_a").exists()


@pytest.mark.slow
def test_a_rolling_deploy__an_old_relay_fans_out_to_the_new_subscriber(vendor):
    """Relay A runs the old version (record_a, record_b). The new version adds
    ``audit``: the deploy records it (``outbox_subscribers --record``, or the
    new relay's start), then relay B of the new version starts. Events
    published in between are fanned out by A, which lacks ``audit`` (or wait
    in its stream), and still reach it through B; every subscriber gets
    every event of its types once."""
    old = spawn("-m", "tests.relay_worker", "record", "--max-seconds", "120")
    new = None
    try:
        assert old.stdout.readline().strip() == "ready"
        before = place(20)  # published before the new version existed
        wait_for(
            lambda: not OutboxEvent.objects.awaiting_fanout().exists(),
            60,
            "the old relay to fan out",
        )
        Subscription.objects.record(
            [Handler(name="audit", event_types=frozenset({"OrderPlaced"}))], "deploy"
        )
        between = place(30)  # the new subscriber exists; only A runs
        # They wait for it: rows the old relay fans out, or in its stream.
        # (An event awaiting fan-out reads PENDING for each subscription of
        # its type already, so the old relay's fan-out is waited for too.)
        wait_for(
            lambda: (
                kit.states("audit")[State.PENDING] == 30
                and not OutboxEvent.objects.awaiting_fanout().exists()
            ),
            60,
            "the events to wait for the new subscriber",
        )
        wait_for(
            lambda: (
                SideEffect.objects.filter(handler__startswith="record_").count() == 100
            ),
            60,
            "the old relay to deliver to its own subscribers",
        )
        if vendor == "sqlite":  # one relay per database file
            old.send_signal(signal.SIGTERM)
            old.communicate(timeout=60)
        new = spawn(
            "-m", "tests.relay_worker", "record", "audit", "--max-seconds", "120"
        )
        after = place(10)
        wait_for(
            lambda: (
                SideEffect.objects.filter(handler="audit").count() == 40
                and SideEffect.objects.filter(handler="record_a").count() == 60
                and SideEffect.objects.filter(handler="record_b").count() == 60
            ),
            90,
            "every subscriber to get every event",
        )
    finally:
        for process in (old, new):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                process.communicate(timeout=60)
    audited = set(
        SideEffect.objects.filter(handler="audit").values_list("event_id", flat=True)
    )
    assert audited == {e.id for e in between + after}
    for name in ("record_a", "record_b"):
        effects = SideEffect.objects.filter(handler=name)
        assert effects.count() == 60
        assert set(effects.values_list("event_id", flat=True)) == {
            e.id for e in before + between + after
        }


STEPS_ELSEWHERE = Handler(name="steps.elsewhere", event_types=frozenset({"Step"}))


def place_steps(n: int) -> list[OutboxEvent]:
    from django.db import transaction

    from outbox_app import publish
    from tests.testapp.events import Step

    with transaction.atomic():
        return publish(*[Step(position=i) for i in range(n)])


def retire_as_fan_out_starts(monkeypatch, module, names):
    """The operator retires ``names`` right after the relay read the
    subscribed types and before its fan-out statement runs."""
    from outbox_app.relay.fanout import subscribed_types

    def types_then_retire(*args, **kwargs):
        types = subscribed_types(*args, **kwargs)
        Subscription.objects.filter(subscriber__in=names).retire("test")
        return types

    monkeypatch.setattr(module, "subscribed_types", types_then_retire)


@pytest.mark.engine("rows")
def test_retiring_the_only_subscriber_as_fan_out_runs_leaves_the_events_pending(
    monkeypatch,
):
    """Its events wait for fan-out (visible in the status) instead of being
    marked fanned out to nobody; fan-out pages past them to the events that
    still have a subscriber."""
    from outbox_app.relay import fanout

    Subscription.objects.record([STEPS_ELSEWHERE, ELSEWHERE], "other-host:1")
    steps = place_steps(3)  # older: the first batches hold them
    orders = place(3)
    retire_as_fan_out_starts(monkeypatch, fanout, ["steps.elsewhere"])
    assert fan_out(subscribers=[], batch_size=2) == 3
    assert set(OutboxEvent.objects.awaiting_fanout().values_list("id", flat=True)) == {
        e.id for e in steps
    }
    assert set(Delivery.objects.values_list("event_id", "subscriber")) == {
        (e.id, "elsewhere") for e in orders
    }
    assert status.overview()["events_awaiting_fanout"] == 3
    # Reactivated, the subscriber gets them: nothing was lost.
    monkeypatch.undo()
    operations.reactivate(Subscription.objects.filter(subscriber="steps.elsewhere"))
    assert fan_out(subscribers=[]) == 3
    assert Delivery.objects.filter(subscriber="steps.elsewhere").count() == 3


@pytest.mark.engine("rows")
def test_retiring_the_only_subscriber_as_a_folded_claim_runs_leaves_it_pending(
    monkeypatch, registered
):
    """The same on the path that fans out while it claims (a lease)."""
    from outbox_app.relay import loop

    @registered("OrderPlaced", name="orders.here")
    def here(event, context):
        pass

    Subscription.objects.record([STEPS_ELSEWHERE], "other-host:1")
    orders = place(1)
    steps = place_steps(3)
    orders += place(3)
    retire_as_fan_out_starts(monkeypatch, loop, ["steps.elsewhere"])
    report = loop.relay_once(batch_size=2)
    assert (report.fanned_out, report.succeeded) == (4, 4)
    assert set(OutboxEvent.objects.awaiting_fanout().values_list("id", flat=True)) == {
        e.id for e in steps
    }
    assert set(Delivery.objects.values_list("event_id", flat=True)) == {
        e.id for e in orders
    }


def test_a_paused_subscriber_is_not_claimed_until_resumed(handlers, caplog):
    """An operator's pause stops the claims of the subscriber (every event
    type), not its fan-out nor the other subscribers; resuming delivers what
    waited, and no attempt was counted meanwhile."""
    handlers("record")
    relay_once()  # records the subscriptions
    rows = Subscription.objects.filter(subscriber="record_a")
    assert operations.pause(rows, by="admin: alice") == 1
    assert operations.pause(rows, by="admin: bob") == 0  # paused already
    assert set(rows.values_list("paused_by", flat=True)) == {"admin: alice"}
    place(3)
    with caplog.at_level(logging.WARNING, logger="outbox_app.relay"):
        report = relay_once()
    assert report.succeeded == 3
    assert states_of("record_a") == [State.PENDING] * 3
    # No attempt was counted.
    assert not Delivery.objects.filter(subscriber="record_a", attempts__gt=0)
    assert states_of("record_b") == [State.SUCCEEDED] * 3
    assert "subscriber record_a is paused by an operator" in caplog.text
    data = status.overview()
    (held,) = data["paused_by_operator"]
    assert (held["subscriber"], held["by"]) == ("record_a", "admin: alice")
    by_name = {row["name"]: row for row in data["subscribers"]}
    assert by_name["record_a"]["paused"]["cause"] == "operator"
    assert by_name["record_b"]["paused"] is None

    assert operations.resume(Subscription.objects.filter(event_type="OrderPlaced"))
    assert relay_once().succeeded == 3
    assert states_of("record_a") == [State.SUCCEEDED] * 3
    assert not Subscription.objects.filter(paused_at__isnull=False).exists()


def test_pause_and_resume_from_the_command_line(handlers):
    handlers("record")
    relay_once()
    out = io.StringIO()
    call_command("outbox_subscribers", "--pause", "record_a", stdout=out)
    assert "Paused record_a" in out.getvalue()
    out = io.StringIO()
    call_command("outbox_subscribers", stdout=out)
    (line,) = [r for r in out.getvalue().splitlines() if r.startswith("record_a ")]
    assert "0 s by manage.py outbox_subscribers" in line
    out = io.StringIO()
    call_command("outbox_status", stdout=out)
    text = out.getvalue()
    assert "PAUSED: record_a for" in text and "by an operator" in text
    (row,) = [r for r in text.splitlines() if r.startswith("record_a ")]
    assert row.split()[-1] == "operator"
    call_command("outbox_subscribers", "--resume", "record_a", stdout=out)
    assert "Resumed record_a." in out.getvalue()
    assert not Subscription.objects.filter(paused_at__isnull=False).exists()
    with pytest.raises(CommandError, match="no subscription of 'nobody'"):
        call_command("outbox_subscribers", "--pause", "nobody")
    with pytest.raises(CommandError, match="go with --retire"):
        call_command("outbox_subscribers", "--pause", "record_a", "--waiting", "keep")


def test_the_subscribers_command_says_whether_a_relay_serves_now(handlers):
    """Relays refresh their subscriptions every minute: one refreshed 3
    minutes ago has no relay serving it now (STALE), though --retire still
    wants --force; an hour ago is UNSERVED. The publisher paused by an outage
    says so."""
    from outbox_app.models import SubscriberPause

    handlers("record")
    relay_once()
    record_elsewhere(seconds_ago=180)
    Subscription.objects.record(
        [Handler(name="gone", event_types=frozenset({"OrderPlaced"}))],
        "old-host:9",
        timezone.now() - datetime.timedelta(hours=1),
    )
    now = timezone.now()
    SubscriberPause.objects.create(
        subscriber="record_b",
        paused_at=now - datetime.timedelta(seconds=90),
        resume_at=now + datetime.timedelta(seconds=5),
        reason="ConnectionRefusedError",
    )
    out = io.StringIO()
    call_command("outbox_subscribers", stdout=out)
    lines = {line.split()[0]: line for line in out.getvalue().splitlines()[1:]}
    header = out.getvalue().splitlines()[0].split()
    assert header[:4] == ["subscriber", "event", "type", "kind"]
    assert " serving " in lines["record_a"] and " ago by " in lines["record_a"]
    assert " STALE " in lines["elsewhere"]
    # The ages grow while the test runs; a loaded machine may add a second.
    assert re.search(r"3 min \d+ s ago by other-host:1", lines["elsewhere"])
    assert " UNSERVED " in lines["gone"]
    assert re.search(r"1 h 0 min ago by old-host:9", lines["gone"])
    assert re.search(r"outage 1 min 3\d s", lines["record_b"])
    assert lines["record_a"].split()[-2:] == ["-", "0"]


@pytest.mark.slow
def test_a_running_relay_honours_a_pause_without_a_restart():
    """A relay process keeps running while an operator pauses one of its
    subscribers, then resumes it: nothing is claimed for it in between, the
    rest flows, and what waited is delivered after the resume."""
    relay = spawn("-m", "tests.relay_worker", "record", "--max-seconds", "120")
    try:
        assert relay.stdout.readline().strip() == "ready"
        wait_for(
            lambda: Subscription.objects.filter(subscriber="record_a").exists(),
            60,
            "the relay to record its subscriptions",
        )
        operations.pause(Subscription.objects.filter(subscriber="record_a"), by="test")
        # A relay turn under way may have read the pauses just before: it
        # reads them again within HELD_REFRESH_SECONDS.
        time.sleep(2 * HELD_REFRESH_SECONDS)
        place(10)
        wait_for(
            lambda: SideEffect.objects.filter(handler="record_b").count() == 10,
            60,
            "the relay to deliver to the subscriber that is not paused",
        )
        time.sleep(2)  # more than a relay turn and its refresh of the pauses
        assert SideEffect.objects.filter(handler="record_a").count() == 0
        assert states_of("record_a") == [State.PENDING] * 10
        operations.resume(Subscription.objects.filter(subscriber="record_a"))
        wait_for(
            lambda: SideEffect.objects.filter(handler="record_a").count() == 10,
            60,
            "the relay to deliver once the subscriber is resumed",
        )
    finally:
        relay.send_signal(signal.SIGTERM)
        relay.communicate(timeout=60)


def test_check_names_a_live_subscription_no_subscriber_here_has(handlers):
    from outbox_app.ops.checks import check_subscriptions

    handlers("record")
    record_elsewhere()  # "elsewhere": a subscriber this process does not have
    [warning] = check_subscriptions(databases=["default"])
    assert warning.id == "outbox.W008" and "'elsewhere'" in warning.msg
    assert "outbox_subscribers --retire elsewhere" in warning.hint
    call_command(
        "outbox_subscribers", "--retire", "elsewhere", "--force", "--waiting", "keep"
    )
    assert check_subscriptions(databases=["default"]) == []
    assert check_subscriptions() == []  # without --database: no query


def test_narrowing_a_subscribers_types_takes_effect_at_the_next_start():
    wide = Handler(name="bus", event_types=None)  # every type
    narrow = Handler(name="bus", event_types=frozenset({"OrderPlaced"}))
    rows = Subscription.objects
    rows.record([wide], "relay:1", started=True)
    rows.record([narrow], "relay:2", started=True)  # deployed narrowed
    live = rows.filter(subscriber="bus", retired_at__isnull=True)
    assert list(live.values_list("event_type", flat=True)) == ["OrderPlaced"]
    # The older relay's heartbeat does not widen it again...
    rows.record([wide], "relay:1")
    assert list(live.values_list("event_type", flat=True)) == ["OrderPlaced"]
    # ...a start with the wide list does: a narrowing is undone, an
    # operator's retire is not.
    rows.filter(subscriber="bus", event_type="OrderPlaced").retire("ops")
    rows.record([wide], "relay:3", started=True)
    assert list(live.values_list("event_type", flat=True)) == ["*"]
    assert rows.get(subscriber="bus", event_type="OrderPlaced").retired_by == "ops"


def test_a_relay_loop_reads_the_subscriptions_at_most_once_a_second(
    handlers, monkeypatch
):
    """A relay's loop keeps what it read of the subscriptions (paused
    subscribers, subscribed types) for a second: a relay woken for one event
    sends its claim and fan-out, not those reads again, and a change made
    meanwhile is seen once the second has passed."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    from outbox_app.relay import loop

    handlers("record")
    clock = [1000.0]
    # The loop's clock only: the process's time.monotonic() also times the
    # database clock's readings, which must stay true after this test.
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(monotonic=lambda: clock[0]))
    view = loop.SubscriptionView("default")
    place(1)
    assert relay_once(view=view).succeeded == 2  # reads them, records them
    place(1)
    with CaptureQueriesContext(connection) as queries:
        assert relay_once(view=view).succeeded == 2
    # (The fan-out statement joins the subscriptions itself, by design.)
    table = connection.ops.quote_name(Subscription._meta.db_table)
    reads = re.compile(rf"SELECT .*? FROM {re.escape(table)}")
    assert not [q for q in queries.captured_queries if reads.match(q["sql"])]
    # An operator pauses record_a: a view older than a second sees it.
    operations.pause(Subscription.objects.filter(subscriber="record_a"), by="ops")
    clock[0] += HELD_REFRESH_SECONDS
    place(1)
    report = relay_once(view=view)
    assert report.succeeded == 1
    assert states_of("record_a")[0] == State.PENDING  # newest first
