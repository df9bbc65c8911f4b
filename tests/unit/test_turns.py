"""The relay's turns on the in-memory store (tests/memory.py), with no
database: subscribers take turns a batch each, claims run ahead, a paused
subscriber gets no claims, a lost lease stops a batch, a publisher keeps one
batch on the wire while the previous one's confirms are collected, and
failures back off to FAILED, then go DEAD. Each test judges what was
delivered and which states an operator would see."""

from __future__ import annotations

import datetime
import random

import pytest

from outbox_app.publishers.base import Publisher
from outbox_app.relay.batch import Batch, ClaimAhead
from outbox_app.relay.loop import deliver
from outbox_app.relay.outcomes import RelayReport
from outbox_app.relay.sending import PublisherRunner
from outbox_app.store.lifecycle import State
from tests.memory import MemoryGateway, MemoryView, moved

pytestmark = pytest.mark.engine("rows")


class Recording(Publisher):
    """A publisher that writes down what it sends and collects (``log``:
    ``(name, step, event numbers)``), with the states the store shows of
    those messages' rows at that moment (``seen``); ``outcome`` gives each
    message's result (None: delivered)."""

    def __init__(self, name, store, log, *, outcome=None, **options):
        super().__init__(name, options)
        self.store = store
        self.log = log
        self.seen: list[set[str]] = []
        self.outcome = outcome or (lambda context: None)

    def send(self, messages):
        self._note("send", messages)
        return list(messages)

    def collect(self, sent):
        self._note("collect", sent)
        return [self.outcome(c) for c in sent]

    def _note(self, step, messages):
        self.log.append((self.name, step, [c.payload["n"] for c in messages]))
        self.seen.append({self.store.rows[c.delivery_id].state for c in messages})


@pytest.fixture
def store():
    return MemoryGateway()


def published(store, count, *names, **columns):
    """``count`` events, numbered from 1, to which ``names`` subscribe."""
    for name in names:
        store.subscribe(name)
    return [
        store.publish("thing.done", {"n": n}, **columns) for n in range(1, count + 1)
    ]


def run(store, *subscribers, **options):
    options.setdefault("view", MemoryView())
    return deliver(
        list(subscribers),
        gateway=store,
        now=store.now(),
        worker="relay:1",
        rng=random.Random(7),
        **options,
    )


def sends(log):
    return [(name, numbers) for name, step, numbers in log if step == "send"]


def test_subscribers_take_turns_a_batch_each(store):
    log = []
    first, second = Recording("first", store, log), Recording("second", store, log)
    published(store, 3, "first", "second")

    report = run(store, first, second, batch_size=1)

    # The first subscriber's fan-out made the second's rows too: it takes
    # its turn after each of the first's batches, not after its backlog.
    assert sends(log) == [
        ("first", [1]),
        ("second", [1]),
        ("first", [2]),
        ("second", [2]),
        ("first", [3]),
        ("second", [3]),
    ]
    assert store.states() == {State.SUCCEEDED: 6}
    assert (report.fanned_out, report.claimed, report.succeeded) == (3, 6, 6)


def test_a_subscriber_paused_by_an_operator_gets_no_claims(store):
    log = []
    paused, running = Recording("paused", store, log), Recording("running", store, log)
    published(store, 2, "paused", "running")

    report = run(store, paused, running, view=MemoryView(held={"paused"}))

    assert sends(log) == [("running", [1, 2])]
    # Its rows wait, never attempted, for it to be resumed.
    assert store.states("paused") == {State.PENDING: 2}
    assert [r.attempts for r in store.of("paused")] == [0, 0]
    assert store.states("running") == {State.SUCCEEDED: 2}
    assert report.succeeded == 2

    report = run(store, paused, running)
    assert sends(log)[-1] == ("paused", [1, 2])
    assert store.states() == {State.SUCCEEDED: 4}


def test_a_publisher_keeps_one_batch_on_the_wire_while_collecting_the_last(store):
    log = []
    publisher = Recording("broker", store, log)
    published(store, 4, "broker")

    report = run(store, publisher, batch_size=2)

    # Batch 2 is sent before batch 1's confirms are collected; nothing is
    # marked SUCCEEDED before its confirm came back.
    assert log == [
        ("broker", "send", [1, 2]),
        ("broker", "send", [3, 4]),
        ("broker", "collect", [1, 2]),
        ("broker", "collect", [3, 4]),
    ]
    assert publisher.seen == [{State.RUNNING}] * 4
    assert store.states() == {State.SUCCEEDED: 4}
    assert report.succeeded == 4


def test_failures_back_off_then_go_to_the_dead_letter(store, settings):
    settings.OUTBOX_RETRY_BASE_SECONDS = 10
    log = []
    publisher = Recording(
        "flaky", store, log, outcome=lambda c: ValueError("nack"), MAX_ATTEMPTS=2
    )
    published(store, 1, "flaky")

    report = run(store, publisher)
    (row,) = store.of("flaky")
    assert (row.state, row.attempts, row.last_error) == (State.FAILED, 1, "nack")
    assert row.next_retry_at > store.now()
    assert row.completed_at is None
    assert report.failed == 1

    # Not due yet: nothing is sent.
    store.advance((row.next_retry_at - store.now()).total_seconds() / 2)
    run(store, publisher)
    assert len(sends(log)) == 1

    store.clock = row.next_retry_at
    report = run(store, publisher)
    assert len(sends(log)) == 2
    assert (row.state, row.attempts) == (State.DEAD, 2)
    assert row.completed_at == store.now()
    assert row.lease_token is None
    assert report.dead == 1


def test_an_ordered_publishers_later_rows_wait_behind_a_failed_one(store, settings):
    settings.OUTBOX_RETRY_BASE_SECONDS = 10
    log = []
    publisher = Recording(
        "ordered",
        store,
        log,
        outcome=lambda c: ValueError("nack") if c.payload["n"] == 1 else None,
        ORDERED=True,
    )
    published(store, 3, "ordered", aggregate=("Order", "7"))
    store.fan_out(None, 100, None, store.now())

    run(store, publisher)

    assert sends(log) == [("ordered", [1])]
    assert [r.state for r in store.of("ordered")] == [
        State.FAILED,
        State.PENDING,
        State.PENDING,
    ]


def test_a_lost_lease_stops_a_batch(store, settings):
    settings.OUTBOX_LEASE_SECONDS = 0.001
    log = []
    publisher = Recording("slow", store, log)
    published(store, 2, "slow")
    store.fan_out(None, 100, None, store.now())
    stalled = Batch.claim(
        publisher, "default", 10, store.now(), "stalled:1", gateway=store
    )
    # The stalled relay's lease ran out: another relay took its rows. (Its own
    # clock stalled as long, whatever the machine's speed.)
    store.advance(1)
    stalled.renewed -= 1
    _, taken = store.claim(
        ["slow"], limit=10, lease_seconds=60, worker="other:1", now=store.now()
    )
    assert len(taken) == 2

    report = RelayReport()
    runner = PublisherRunner(publisher, "default")
    runner.deliver(stalled, report, last=True)
    runner.close()

    # It renewed before sending, found the rows gone, and sent nothing.
    assert log == []
    assert report.lost == 2
    assert {(r.state, r.locked_by, r.attempts) for r in store.of()} == {
        (State.RUNNING, "other:1", 2)
    }


def test_the_next_batch_is_claimed_ahead_and_handed_back_when_not_needed(store):
    log = []
    publisher = Recording("backlog", store, log)
    ordered = Recording("ordered", store, log, ORDERED=True)
    published(store, 4, "backlog")
    store.fan_out(None, 100, None, store.now())
    ahead = ClaimAhead("default")
    ahead.sidecar.enabled = True  # a second connection, as on PostgreSQL

    def claim(subscriber):
        return Batch.claim(subscriber, "default", 2, store.now(), "w:1", gateway=store)

    ahead.submit(publisher, claim)
    assert ahead.take(ordered) is None  # claimed for another subscriber
    batch = ahead.take(publisher)
    assert [c.payload["n"] for c in batch.contexts] == [1, 2]
    ahead.submit(ordered, claim)  # never ahead: its heads follow this batch
    assert ahead.pending is None
    ahead.submit(publisher, claim)
    report = ahead.close()  # time is up: the batch ahead is not delivered

    assert (report.claimed, report.released) == (2, 2)
    rows = store.of("backlog")
    assert [(r.state, r.attempts) for r in rows] == [
        (State.RUNNING, 1),
        (State.RUNNING, 1),
        (State.PENDING, 0),
        (State.PENDING, 0),
    ]


def test_expired_events_are_skipped_unattempted(store):
    log = []
    publisher = Recording("late", store, log)
    published(store, 1, "late", expires_at=store.now() - datetime.timedelta(seconds=1))

    report = run(store, publisher)

    assert log == []
    (row,) = store.of("late")
    assert (row.state, row.attempts) == (State.SKIPPED, 0)
    assert row.last_error_type.endswith("EventExpired")
    assert report.lapsed == 1


def test_the_store_refuses_a_change_the_lifecycle_does_not_allow(store):
    published(store, 1, "done")
    store.fan_out(None, 10, None, store.now())
    (row,) = store.of()
    row_id = row.id
    token, _ = store.claim(
        ["done"], limit=1, lease_seconds=60, worker="w", now=store.now()
    )
    assert store.succeed(token, [row_id], store.now()) == 1

    with pytest.raises(AssertionError, match="claim: SUCCEEDED -> RUNNING"):
        moved(store.rows[row_id], "claim", State.RUNNING)
    with pytest.raises(AssertionError, match="not a transition"):
        moved(store.rows[row_id], "resurrect", State.PENDING)
