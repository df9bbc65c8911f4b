"""Relays whose hosts' clocks are wrong: leases, due times and expiry are
compared with the database's clock, never the relay host's.

The process test runs three relay processes side by side, one under
libfaketime 90 s ahead, one 90 s behind, one at true time (the test's own
clock, which is the database servers' on this machine). SQLite is embedded:
its clock is the relay process's own, and one relay runs per file.
"""

from __future__ import annotations

import datetime
import decimal
import json
import shutil
import time
from collections import Counter

import pytest
from django.db import transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.models import Subscription
from outbox_app.ops.purge import cutoff_for
from outbox_app.relay import deliver, fan_out, relay_once
from outbox_app.relay.batch import Batch
from outbox_app.relay.registry import get
from outbox_app.store.clock import database_now
from outbox_app.store.lifecycle import State
from tests.processes import spawn, wait_for
from tests.testapp.events import OrderPlaced

pytestmark = [pytest.mark.django_db(transaction=True)]

MINUTE = datetime.timedelta(minutes=1)
#: How late a delivery may be after it is due: the workers poll every 20 ms,
#: a handler takes 0.3 s, a batch of a few of them runs one after another,
#: and the machine is shared.
LATE_SECONDS = 3.0


def _relay(log, clock, *sets):
    process = spawn(
        "-m",
        "tests.relay_worker",
        *sets,
        "--batch-size",
        "2",
        "--max-seconds",
        "120",
        clock=clock,
        OUTBOX_TEST_LOG=str(log),
    )
    line = process.stdout.readline().strip()
    if line != "ready":
        process.kill()
        raise AssertionError(f"relay under {clock}: {process.communicate()[1]}")
    return process


@pytest.mark.slow
@skipUnlessDBFeature("has_select_for_update_skip_locked")
def test_relays_90_s_ahead_and_behind_beside_one_on_time(tmp_path):
    """No handler runs twice (a relay ahead does not take over leases that
    have not run out, one behind does not write leases that have), no
    scheduled event goes out early, and none waits for a skewed relay's
    clock: each is delivered within a few seconds of being due."""
    if shutil.which("faketime") is None:
        pytest.fail("faketime is not installed (apt-get install faketime)")
    log = tmp_path / "runs"
    log.touch()
    relays = []
    try:
        relays.append(_relay(log, "+90s", "clock_a"))
        relays.append(_relay(log, "-90s", "clock_b"))
        relays.append(_relay(log, None, "clock_a", "clock_b"))
        wait_for(
            lambda: (
                Subscription.objects.filter(
                    subscriber__in=["clock_a", "clock_b"]
                ).count()
                == 2
            ),
            30,
            "the relays to record their subscribers",
        )
        due: dict[str, datetime.datetime] = {}
        scheduled: set[str] = set()
        seen: dict[tuple[str, str], datetime.datetime] = {}
        runs: Counter = Counter()
        read = 0

        def watch() -> None:
            nonlocal read
            with open(log) as lines:
                lines.seek(read)
                text = lines.read()
            complete = text[: text.rfind("\n") + 1]
            read += len(complete)
            now = timezone.now()
            for line in complete.splitlines():
                name, event_id = line.split()
                runs[name, event_id] += 1
                seen.setdefault((name, event_id), now)

        for i in range(12):
            deliver_at = (
                timezone.now() + datetime.timedelta(seconds=2) if i % 3 else None
            )
            with transaction.atomic():
                [event] = publish(
                    OrderPlaced(order_id=i, total=decimal.Decimal(i)),
                    deliver_at=deliver_at,
                )
            due[str(event.id)] = deliver_at or event.created_at
            if deliver_at is not None:
                scheduled.add(str(event.id))
            for _ in range(10):  # 0.5 s apart
                watch()
                time.sleep(0.05)
        wanted = {(name, e) for name in ("clock_a", "clock_b") for e in due}

        def done() -> bool:
            watch()
            return wanted <= seen.keys()

        try:
            wait_for(done, 30, "every event to reach both handlers")
        finally:
            time.sleep(1)  # a second run of something would show by now
            watch()
            twice = sorted(key for key, count in runs.items() if count > 1)
            early = sorted(
                (name, e, (due[e] - at).total_seconds())
                for (name, e), at in seen.items()
                if e in scheduled and at < due[e]
            )
            late = sorted(
                (name, e, (at - due[e]).total_seconds())
                for (name, e), at in seen.items()
                if (at - due[e]).total_seconds() > LATE_SECONDS
            )
            assert (twice, early, late) == ([], [], []), (
                f"missing {sorted(wanted - seen.keys())}"
            )
    finally:
        for relay in relays:
            relay.kill()
            relay.communicate(timeout=30)


# --- in one process: the host's clock moved under the relay -----------------------

skewed_databases = skipUnlessDBFeature("has_select_for_update_skip_locked")


@pytest.fixture
def skew(monkeypatch):
    """``skew(seconds)``: this process's wall clock (``timezone.now()``) is
    ``seconds`` off from now on; the database's clock is not. The clock
    readings of earlier tests are forgotten."""
    from outbox_app.store import clock

    real = timezone.now

    def move(seconds: float) -> None:
        monkeypatch.setattr(
            timezone, "now", lambda: real() + datetime.timedelta(seconds=seconds)
        )

    monkeypatch.setattr(clock, "_readings", {})
    yield move


def true_now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def near(moment: datetime.datetime, seconds: float = 5) -> bool:
    return abs((moment - true_now()).total_seconds()) < seconds


def place(n: int, **schedule):
    with transaction.atomic():
        return publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(n)],
            **schedule,
        )


@skewed_databases
@pytest.mark.parametrize("seconds", [90, -90])
def test_database_now_is_the_servers_clock_whatever_the_hosts(skew, seconds):
    skew(seconds)
    assert not near(timezone.now())
    assert near(database_now(), 1)
    assert near(database_now("default"), 1)


def test_sqlite_has_the_process_clock(skew, vendor):
    if vendor != "sqlite":
        return
    skew(90)
    assert abs((database_now() - timezone.now()).total_seconds()) < 0.1


@skewed_databases
@pytest.mark.engine("rows")  # a row's lease; a cursor's: below
def test_a_relay_ahead_takes_over_no_lease_that_has_not_run_out(skew, registered):
    runs = []

    @registered(OrderPlaced, name="clock.runs")
    def runs_of(event, context):
        runs.append(context.event_id)

    place(3)
    fan_out()
    held = Batch.claim(get("clock.runs"), "default", 10, None, "elsewhere:1")
    assert len(held) == 3
    skew(90)  # past the 60 s lease by this host's clock
    assert deliver([get("clock.runs")]).claimed == 0
    assert runs == []
    rows = Delivery.objects.all()
    assert set(rows.values_list("locked_by", flat=True)) == {"elsewhere:1"}
    assert all(near(r.locked_until - datetime.timedelta(seconds=60)) for r in rows)


@skewed_databases
@pytest.mark.engine("rows")  # a row's lease; a cursor's: below
def test_a_relay_behind_writes_leases_by_the_databases_clock(skew, registered):
    @registered(OrderPlaced, name="clock.behind")
    def behind(event, context):
        pass

    place(2)
    skew(-90)
    fan_out()
    batch = Batch.claim(get("clock.behind"), "default", 10, None, "behind:1")
    assert len(batch) == 2
    for row in Delivery.objects.all():
        assert near(row.locked_until - datetime.timedelta(seconds=60))
        assert near(row.created_at)
    assert Delivery.objects.due().count() == 0  # nobody else may take them


@skewed_databases
def test_a_relay_ahead_delivers_no_scheduled_event_early(skew, registered):
    seen = []

    @registered(OrderPlaced, name="clock.scheduled")
    def scheduled(event, context):
        seen.append(event.order_id)

    place(1, deliver_at=datetime.timedelta(seconds=30))
    skew(90)
    assert relay_once().succeeded == 0
    assert seen == []
    assert relay_once(now=true_now() + MINUTE).succeeded == 1
    assert seen == [0]


@pytest.mark.engine("stream")
@pytest.mark.only_database("postgresql")  # SQLite's clock is the process's
def test_a_relay_ahead_takes_over_no_cursor_lease_that_has_not_run_out(
    skew, registered
):
    from outbox_app.relay.stream import Cursors

    runs = []

    @registered(OrderPlaced, name="clock.cursor")
    def runs_of(event, context):
        runs.append(context.event_id)

    place(3)
    # Another relay holds the subscriber's cursors for a minute by the
    # database's clock.
    assert Cursors("default", "elsewhere:1").of(get("clock.cursor"), database_now())
    skew(90)  # past the 60 s lease by this host's clock
    assert relay_once().claimed == 0
    assert runs == []
    assert relay_once(now=database_now() + 2 * MINUTE).succeeded == 3


@skewed_databases
@pytest.mark.engine("rows")  # what a delivery row stores
@pytest.mark.parametrize("seconds", [90, -90])
def test_what_a_skewed_relay_stores_is_by_the_databases_clock(
    skew, registered, seconds
):
    """Due times of new rows and of retries, completions, heartbeats."""

    @registered(OrderPlaced, name="clock.fails")
    def fails(event, context):
        if event.order_id:
            raise ConnectionError("down")

    place(2)
    skew(seconds)
    report = relay_once()
    assert (report.succeeded, report.failed) == (1, 1)
    done = Delivery.objects.get(state=State.SUCCEEDED)
    assert near(done.completed_at) and near(done.updated_at)
    failed = Delivery.objects.get(state=State.FAILED)
    assert near(failed.first_failed_at)
    retry = (failed.next_retry_at - failed.first_failed_at).total_seconds()
    # OUTBOX_RETRY_BASE_SECONDS' first backoff, jittered down to ~0; the
    # retry is reckoned from the batch's clock and the failure stamped a
    # moment later by the database's, so "0" may read a few microseconds
    # early (it did, once, in CI): a skew would show as 90 s.
    assert -0.01 <= retry <= 1.5
    subscription = Subscription.objects.get(subscriber="clock.fails")
    assert near(subscription.last_seen_at)


@skewed_databases
@pytest.mark.engine("rows")  # fanned-out rows, retried and requeued
@pytest.mark.parametrize("seconds", [90, -90])
def test_operator_actions_on_a_skewed_host_use_the_databases_clock(skew, seconds):
    from outbox_app.publishers.kombu import _ttl
    from outbox_app.subscribers import DeliveryContext, Handler

    place(3)
    fan_out(subscribers=[Handler(name="clock.op", event_types=None)])
    rows = Delivery.objects.all()
    rows.update(state=State.FAILED, next_retry_at=true_now() + MINUTE)
    skew(seconds)
    assert rows.retry_now() == 3
    assert all(near(r.next_retry_at) for r in rows)
    rows.update(state=State.DEAD)
    assert rows.requeue() == 3
    assert all(near(r.next_retry_at) for r in rows)
    assert near(cutoff_for(0))
    expires = true_now() + datetime.timedelta(seconds=60)
    context = DeliveryContext(
        **{
            **{f: None for f in DeliveryContext.__dataclass_fields__},
            "expires_at": expires,
        }
    )
    # Within a second of the minute left (the database's clock reads its own
    # time, a hair off the host's); a 90 s skew would be far outside.
    assert 55_000 <= _ttl(context) <= 61_000


# --- a writer whose host's clock is wrong --------------------------------------------


@pytest.mark.slow
@skewed_databases
def test_a_writer_behind_the_database_counts_from_the_databases_clock(registered):
    """A web or worker host 120 s behind the database turned "a minute from
    now" into a time a minute gone: its expiring event was skipped as expired
    the moment it committed (and nothing told the caller), its scheduled
    event and its countdown task went out at once. Relative times are now
    counted from the database's clock, "not after now" is checked against
    it, and so is the event's own time stamped."""
    if shutil.which("faketime") is None:
        pytest.fail("faketime is not installed (apt-get install faketime)")
    seen = []

    @registered(OrderPlaced, name="clock.writer")
    def record(event, context):
        seen.append(event.order_id)

    tasks = {"tasks": {"BACKEND": "outbox_app.publishers.celery.CeleryPublisher"}}
    writer = spawn(
        "-m",
        "tests.clock_writer",
        clock="-120s",
        OUTBOX_TEST_PUBLISHERS=json.dumps(tasks),
    )
    out, err = writer.communicate(timeout=120)
    assert writer.returncode == 0, err
    written = json.loads(out)
    now = database_now()
    # A minute after its own clock is a minute ago by the database's: refused.
    assert "is not after now" in (written["refused"] or "")
    relay_once(kind="handler")
    assert seen == [1]  # the expiring event is delivered, the scheduled one waits
    relay_once(kind="handler", now=now + datetime.timedelta(seconds=50))
    assert seen == [1]
    relay_once(kind="handler", now=now + datetime.timedelta(seconds=65))
    assert seen == [1, 2]
    task = OutboxEvent.objects.get(id=written["task"])
    due = (task.deliver_at - now).total_seconds()
    expires = datetime.datetime.fromisoformat(task.payload["options"]["expires"])
    assert 50 < due <= 60 and 110 < (expires - now).total_seconds() <= 120
    event = OutboxEvent.objects.get(id=written["expiring"])
    assert abs((event.occurred_at - now).total_seconds()) < 10


@skewed_databases
def test_a_writer_reads_the_clock_again_inside_its_transaction(monkeypatch):
    """``publish()`` runs in its caller's transaction, where a relay never
    reads the clock again: a web process would count from its first reading
    for good, and that estimate runs on the monotonic clock, which stops
    while a virtual machine is suspended. A writer reads it again there once
    the reading is due."""
    from outbox_app.store import clock

    suspended = clock._Reading(  # read an hour before a suspend of an hour
        at=true_now() - datetime.timedelta(hours=1),
        monotonic=time.monotonic() - clock.CLOCK_REFRESH_SECONDS - 1,
        error=0.001,
    )
    monkeypatch.setattr(clock, "_readings", {"default": suspended})
    with transaction.atomic():
        assert not near(database_now(), 3000)  # the relay's rule: no query here
        [event] = publish(
            OrderPlaced(order_id=1, total=decimal.Decimal(1)), expires_at=MINUTE
        )
    assert near(event.occurred_at) and near(event.expires_at - MINUTE)
