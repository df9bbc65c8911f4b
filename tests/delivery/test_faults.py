"""Faults of the delivery path found by a code reading and a soak: each test
failed before its fix.

(a) a relay frozen inside fan-out stopped every other relay; (b) ordered
delivery could invert aggregate versions across fan-out batches; (c) a relay
that lost its lease went on running its stale batch; (e) a handler timeout
firing inside a database call lost the group's outcomes. (d), one publisher
shared by threads, is in tests/brokers/test_threads.py.
"""

from __future__ import annotations

import datetime
import random
import signal
import socket
import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.events.ids import new_event_id
from outbox_app.models import SubscriberPause, Subscription
from outbox_app.publishers.base import Publisher
from outbox_app.relay.registry import get
from outbox_app.store.lifecycle import State
from tests import kit
from tests.kit import free_port
from tests.processes import spawn, wait_for
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import SideEffect

from .test_delivery import deliver, fan_out, later, place, relay_once

pytestmark = pytest.mark.django_db(transaction=True)


def steal(subscriber, expected: int, seconds: float = 3600) -> int:
    """Another relay claims ``subscriber``'s rows once their leases ran out: a
    claim on its own connection, in a thread, with a clock ``seconds`` ahead,
    repeated (a claim skips a row another relay's scan has locked for an
    instant) until it holds ``expected`` rows or a second has passed. Returns
    how many it took."""
    from outbox_app.relay.batch import Batch

    taken = [0]

    def run():
        found = get(subscriber) if isinstance(subscriber, str) else subscriber
        deadline = time.monotonic() + 1
        try:
            while taken[0] < expected and time.monotonic() < deadline:
                batch = Batch.claim(found, "default", 1000, later(seconds), "thief:1")
                taken[0] += len(batch.contexts)
        finally:
            connections["default"].close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    return taken[0]


# --- (a) a relay frozen inside fan-out ----------------------------------------


@pytest.mark.slow
@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_a_relay_frozen_inside_fan_out_stops_no_other_relay(handlers, tmp_path):
    handlers("record")
    early = place(50)
    fan_out()  # deliveries fanned out long before the freeze
    waiting = place(100)
    marker = tmp_path / "frozen"
    frozen = spawn(
        "-m",
        "tests.relay_worker",
        "record",
        "--batch-size",
        "10",
        "--stall-after",
        r"INSERT .*outbox_app_delivery",
        OUTBOX_TEST_MARKER=str(marker),
    )
    try:
        wait_for(
            lambda: marker.exists() or frozen.poll() is not None,
            60,
            "the relay to freeze inside fan-out",
        )
        assert frozen.poll() is None, frozen.communicate()[1][-3000:]
        other = spawn("-m", "tests.relay_worker", "record", "--max-seconds", "8")
        try:
            _, err = other.communicate(timeout=60)
        finally:
            if other.poll() is None:  # it waited on the frozen relay's locks
                other.kill()
                other.communicate(timeout=10)
        assert other.returncode == 0, err[-3000:]
        # The other relay delivered what was fanned out before, and fanned out
        # and delivered every event the frozen one does not hold.
        done = Delivery.objects.filter(state=State.SUCCEEDED)
        assert done.filter(event_id__in=[e.id for e in early]).count() == 100
        held = OutboxEvent.objects.filter(
            id__in=[e.id for e in waiting], fanned_out=False
        ).count()
        assert held <= 10
        assert done.count() >= 2 * (150 - 10)
    finally:
        frozen.send_signal(signal.SIGKILL)
        frozen.communicate(timeout=10)
    # Once the database has ended its session (at once, or when it notices
    # the closed socket), its batch is fanned out by a later relay pass; every
    # event reaches each handler once.
    wait_for(
        lambda: (
            relay_once() is not None
            and not OutboxEvent.objects.awaiting_fanout().exists()
            and not Delivery.objects.exclude(state=State.SUCCEEDED).exists()
        ),
        30,
        "the frozen relay's batch to be delivered by another relay",
    )
    for name in ("record_a", "record_b"):
        effects = SideEffect.objects.filter(handler=name)
        assert effects.count() == 150
        assert effects.values("event_id").distinct().count() == 150


# --- (b) ordered delivery across fan-out batches ------------------------------


@pytest.mark.engine("rows")
def test_ordered_delivery_keeps_versions_in_order_across_fan_out_batches(
    registered,
):
    seen = []

    @registered(Step, name="versions", ordered=True)
    def versions(event, context):
        seen.append(context.aggregate_version)

    # Version 2 has the smaller id: two hosts whose clocks differ, or ids the
    # caller supplied.
    low, high = sorted([new_event_id(), new_event_id()])
    cart = ("shop.Cart", "v")
    with transaction.atomic():
        publish(
            {"event_type": "Step", "payload": {"position": 1}, "id": high},
            aggregate=cart,
            aggregate_version=1,
        )
    with transaction.atomic():
        publish(
            {"event_type": "Step", "payload": {"position": 2}, "id": low},
            aggregate=cart,
            aggregate_version=2,
        )
    # Fan-out pages by id: its first batch holds version 2 alone.
    assert fan_out(batch_size=1, max_seconds=0) == 1
    deliver()
    relay_once()
    assert seen == [1, 2]


# --- (c) a relay that lost its lease ------------------------------------------


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_a_handler_batch_whose_lease_was_taken_stops(registered, settings):
    settings.OUTBOX_LEASE_SECONDS = 1.0
    calls, stolen = [], []

    @registered(OrderPlaced, name="stalls")
    def stalls(event, context):
        calls.append(context.delivery_id)
        if len(calls) == 1:
            # A stall past the lease: another relay takes the batch over.
            stolen.append(steal("stalls", 6))
            time.sleep(0.15)

    place(6)
    fan_out()
    report = deliver([get("stalls")], batch_size=6)
    assert stolen == [6]
    assert len(calls) == 1, "handlers ran on rows another relay holds"
    assert report.lost == 6 and report.succeeded == 0
    assert set(Delivery.objects.values_list("locked_by", flat=True)) == {"thief:1"}


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_a_handler_with_callbacks_whose_lease_was_taken_commits_nothing(
    registered, settings
):
    """A handler whose on_commit callbacks run after the commit is fenced by
    its lease in the group's transaction like the others: taken over
    meanwhile, its writes roll back and its callbacks never run."""
    settings.OUTBOX_LEASE_SECONDS = 1.0
    sent, stolen = [], []

    @registered(OrderPlaced, name="cb.stalls")
    def stalls(event, context):
        SideEffect.objects.create(handler="cb.stalls", event_id=context.event_id)
        transaction.on_commit(lambda: sent.append(context.event_id))
        stolen.append(steal("cb.stalls", 1))

    place(1)
    fan_out()
    report = deliver([get("cb.stalls")], batch_size=1)
    assert stolen == [1]
    assert (report.succeeded, report.lost) == (0, 1)
    assert sent == []
    assert not SideEffect.objects.exists()
    assert Delivery.objects.get().locked_by == "thief:1"


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_a_batch_claimed_ahead_whose_lease_ran_out_is_not_run(registered, settings):
    settings.OUTBOX_LEASE_SECONDS = 1.0
    calls, stolen = [], []

    @registered(OrderPlaced, name="long_batch")
    def long_batch(event, context):
        calls.append(context.delivery_id)
        if len(calls) == 5:
            # The first batch outlasts the lease of the batch claimed ahead
            # (and its own): another relay takes both over.
            time.sleep(0.3)
            stolen.append(steal("long_batch", 10))

    place(10)
    fan_out()
    report = deliver([get("long_batch")], batch_size=5)
    assert stolen == [10]
    assert len(calls) == 5, "handlers ran on rows another relay holds"
    assert (report.succeeded, report.lost) == (0, 10)


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_a_publisher_batch_whose_lease_ran_out_is_not_sent(settings):
    settings.OUTBOX_LEASE_SECONDS = 1.0
    sent, stolen = [], []

    class Slow(Publisher):
        def send_batch(self, messages):
            sent.extend(m.delivery_id for m in messages)
            if len(sent) == 5:
                time.sleep(0.3)
                stolen.append(steal(self, 10))
            return [None] * len(messages)

    slow = Slow("slow", {})
    place(10)
    fan_out(subscribers=[slow])
    report = deliver([slow], batch_size=5)
    assert stolen == [10]
    assert len(sent) == 5, "a batch another relay holds was sent"
    assert (report.succeeded, report.lost) == (0, 10)


# --- (e) a handler timeout inside a database call -----------------------------


def slow_query_sql(seconds: float) -> str:
    if connection.vendor == "postgresql":
        return f"SELECT pg_sleep({seconds})"
    if connection.vendor == "mysql":
        return f"SELECT SLEEP({seconds})"
    # SQLite has no sleep: count long enough.
    return (
        "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c "
        f"WHERE x < {int(seconds * 4_000_000)}) SELECT count(*) FROM c"
    )


def test_a_timeout_during_a_database_call_fails_only_that_handler(registered):
    sql = slow_query_sql(0.8)

    @registered(OrderPlaced, name="querying", timeout=0.2)
    def querying(event, context):
        if event.order_id == 1:
            with connection.cursor() as cursor:
                cursor.execute(sql)
        SideEffect.objects.create(handler="querying", event_id=context.event_id)

    place(3)
    report = relay_once()
    assert (report.succeeded, report.failed) == (2, 1)
    failed = Delivery.objects.get(state=State.FAILED)
    assert failed.last_error_type == "outbox_app.exceptions.CallTimeout"
    assert not Delivery.objects.filter(state=State.RUNNING).exists()
    assert SideEffect.objects.count() == 2


# --- a backlog that outlasts the time budget ------------------------------------


def test_a_backlog_outlasting_the_time_budget_starves_no_other_subscriber(
    registered,
):
    """Found by the soak (bench/soak.py): every relay_once() started with the
    same subscriber, so one whose batches outlasted the time budget kept the
    others from ever getting a turn."""

    @registered("OrderPlaced", name="a_slow")
    def a_slow(event, context):
        time.sleep(0.02)  # a batch of 50: 1 s, the whole budget

    @registered("OrderPlaced", name="b_fast")
    def b_fast(event, context):
        pass

    place(300)
    # The slow subscriber's backlog (6 batches of 50, each longer than the
    # budget) outlasts these calls: without turns, b_fast would get none.
    # Three calls, not two: on a loaded machine the first call's budget may
    # run out before its first batch is claimed.
    for _ in range(3):
        relay_once(batch_size=50, max_seconds=0.5)
    slow, fast = kit.states("a_slow"), kit.states("b_fast")
    assert slow[State.SUCCEEDED] and fast[State.SUCCEEDED]
    # a_slow's backlog is not drained: the turns did it.
    assert slow[State.PENDING]


@pytest.mark.engine("rows")
def test_a_replayed_row_of_an_event_not_fanned_out_is_claimed_once(registered):
    """Found by the lifecycle state machine (tests/fuzz/test_lifecycle.py) on
    SQLite and MariaDB: a claim took the replayed row as due, its folded
    fan-out took the row's event and read the row back by lease token, and
    the batch listed it twice (the handler ran twice for one attempt)."""
    from outbox_app.ops import subscriptions
    from outbox_app.relay.batch import Batch, Fold
    from outbox_app.relay.fanout import subscribed_types
    from outbox_app.relay.registry import subscribers

    calls = []

    @registered("OrderPlaced", name="once")
    def once(event, context):
        calls.append(context.delivery_id)

    place(1)
    subscriptions.replay_to(OutboxEvent.objects.all(), "once")
    batch = Batch.claim(
        get("once"), "default", 10, None, "w:1", Fold(subscribed_types(subscribers()))
    )
    assert [c.delivery_id for c in batch.contexts] == list(
        Delivery.objects.filter(subscriber="once").values_list("id", flat=True)
    )
    batch.release()
    report = deliver([get("once")])
    assert (report.succeeded, report.lost) == (1, 0)
    assert len(calls) == 1


@skipUnlessDBFeature("has_select_for_update_skip_locked")
@pytest.mark.engine("rows")
def test_no_batch_is_claimed_ahead_for_a_paused_publisher(registered):
    """Found by the soak: under a handler backlog, the next turn's batch was
    claimed ahead for a paused publisher and handed back at every iteration
    (72,114 releases in a 60 s outage), each a window in which a relay killed
    meanwhile left an attempt counted on a row never sent."""

    from outbox_app.relay.sending import pauses

    class Down(Publisher):
        def send_batch(self, messages):
            raise AssertionError("a paused publisher was sent to")

    down = Down("down", {})

    @registered("OrderPlaced", name="busy")
    def busy(event, context):
        pass

    place(30)
    fan_out(subscribers=[down, get("busy")])
    pauses.pause(down, ConnectionError("refused"), timezone.now(), "default")
    try:
        report = deliver([get("busy"), down], batch_size=10)
    finally:
        pauses.clear()
    assert report.succeeded == 30
    assert report.released == 0
    assert Delivery.objects.filter(subscriber="down", attempts=0).count() == 30


# --- a publisher without probe() ------------------------------------------------


def test_a_publisher_without_a_probe_backs_off_instead_of_flapping(caplog):
    """Found by a new user: the docs' webhook publisher (no ``probe()``), its
    endpoint down, paused and resumed about twice a second (an ERROR and a
    WARNING line and a POST each time), since the default probe always
    passes. The first batch after a resume is the probe that decides: its
    outage counts as a failed probe, so the probe schedule (0.5 s doubling to
    ``OUTBOX_PAUSE_MAX_SECONDS``) holds for every publisher."""
    port = free_port()
    batches = []

    class Probeless(Publisher):  # no probe(): the next batch is the probe
        def send_batch(self, messages):
            batches.append(len(messages))
            # Refused while nothing listens on the port: an outage (OSError).
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            return [None] * len(messages)

    hook = Probeless("hook", {})
    Subscription.objects.record([hook], "deploy")  # as a deploy records it
    place(3)
    fan_out(subscribers=[hook])
    start = timezone.now()
    rng = random.Random(7)
    for tenth in range(600):  # a minute of the relay's clock
        deliver([hook], now=start + _tenths(tenth), rng=rng)
    paused = [r for r in caplog.records if "publisher paused" in r.getMessage()]
    resumed = [r for r in caplog.records if "publisher resumed" in r.getMessage()]
    assert (len(paused), len(resumed)) == (1, 0)
    # Sends at 0 s, then after 0.25-0.5, 0.5-1, 1-2, ... 15-30, 15-30 s more:
    # at most 9 in a minute (it was about 150).
    assert 6 <= len(batches) <= 9, batches
    pause = SubscriberPause.objects.get()
    assert pause.resumed_at is None and pause.probes == len(batches) - 1
    assert kit.states("hook") == {State.PENDING: 3}
    assert not Delivery.objects.filter(attempts__gt=0).exists()
    with socket.create_server(("127.0.0.1", port)):  # the endpoint is back
        report = deliver([hook], now=start + _tenths(1200), rng=rng)
    assert report.succeeded == 3
    resumed = [r for r in caplog.records if "publisher resumed" in r.getMessage()]
    assert len(resumed) == 1
    assert SubscriberPause.objects.get().resumed_at is not None


def _tenths(count: int) -> datetime.timedelta:
    return datetime.timedelta(seconds=count / 10)
