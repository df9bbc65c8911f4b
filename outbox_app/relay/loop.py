"""The relay's loop: fan out, then claim and deliver batch by batch.

The ``relay`` management command, the Celery tasks and the tests call these;
each is bounded by a batch size and a time budget and returns counts. No
transaction or row lock is open while a broker call runs, and none but a
handler group's own while handlers run. Under a backlog (a full batch) the
next batch is claimed on a second connection while this one is delivered
(PostgreSQL, MySQL/MariaDB; :class:`~outbox_app.relay.batch.ClaimAhead`),
and a publisher keeps one batch on the wire while the previous one's confirms
are collected (:mod:`outbox_app.relay.sending`).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Iterable, Sequence
from datetime import datetime

from django.db import connections
from django.db.models import Min

from ..conf import outbox_settings
from ..events.ids import worker_name
from ..execution.metrics import relay_metrics
from ..publishers.base import Publisher
from ..store.clock import database_now
from ..store.gateway import Gateway
from ..store.lifecycle import CLAIMABLE
from ..store.models import Delivery, OutboxEvent, Subscription
from ..subscribers import Handler, Kind, Subscriber
from . import registry
from .batch import Batch, ClaimAhead, Fold
from .fanout import fan_out, recorded_types, subscribed_types
from .handlers import run_handlers
from .outcomes import RelayReport
from .sending import PublisherRunner, pauses
from .stream import Cursors, NotContiguous, StreamBatch, streaming

logger = logging.getLogger("outbox_app.relay")

#: database alias -> the subscriber the next deliver() call starts with.
_next_first: dict[str, str] = {}

#: How often a relay reads again which subscribers an operator paused
#: (``Subscription.paused_at``) and which event types are subscribed, while
#: it drains a backlog or, in a running relay, across its turns
#: (:class:`SubscriptionView`).
HELD_REFRESH_SECONDS = 1.0
#: database alias -> the subscribers this process last found paused (logged
#: once when a pause begins and once when it ends).
_held_seen: dict[str, set[str]] = {}


class Held:
    """The subscribers an operator paused (``outbox_subscribers --pause``, the
    admin's action), read at most once every :data:`HELD_REFRESH_SECONDS`:
    the relay claims nothing for them, without a restart."""

    def __init__(self, using: str):
        self.using = using
        self.names: set[str] = set()
        self.read_at: float | None = None

    def __contains__(self, name: str) -> bool:
        clock = time.monotonic()
        if self.read_at is None or clock - self.read_at >= HELD_REFRESH_SECONDS:
            self.read_at = clock
            self.names = Subscription.objects.using(self.using).paused_names()
            before = _held_seen.get(self.using, set())
            for paused in sorted(self.names - before):
                logger.warning(
                    "subscriber %s is paused by an operator: its deliveries "
                    "wait until it is resumed (manage.py outbox_subscribers "
                    "--resume %s)",
                    paused,
                    paused,
                )
            for resumed in sorted(before - self.names):
                logger.info("subscriber %s is resumed by an operator", resumed)
            _held_seen[self.using] = self.names
        return name in self.names


class SubscriptionView:
    """What a relay reads of the subscriptions between batches: the
    subscribers an operator paused (:attr:`held`) and the event types some
    active subscription receives (:meth:`types`), each read at most once every
    :data:`HELD_REFRESH_SECONDS`.

    A :func:`deliver` or :func:`relay_once` call reads them afresh unless it
    is given one; a relay's loop keeps one for its life, so a relay woken for
    one event sends its claim, not these reads, first. A change made
    elsewhere (a pause, a new subscription) is seen within a second: the
    fan-out statement itself reads which subscriptions exist, so stale types
    only delay the fan-out of a newly subscribed type by that second.
    """

    def __init__(self, using: str):
        self.using = using
        self.held = Held(using)
        self._types: frozenset[str] | None = None
        self._read: tuple[tuple[str, ...], float] | None = None
        self._recorded: dict[str, frozenset[str] | None] = {}
        self._recorded_at: float | None = None
        self._cursors: Cursors | None = None
        self._due: dict[str, datetime] = {}
        self._due_read: float | None = None
        self._awaiting = False
        self._fanout_read: float | None = None

    def stream_types(self, subscriber: Subscriber) -> frozenset[str] | None:
        """The event types stream delivery reads for ``subscriber``: those of
        its active subscriptions, whichever relay recorded them
        (:func:`~outbox_app.relay.fanout.recorded_types`, read at most once
        a second); its own where it was never recorded; none (an empty set:
        its cursor stays where it is) where every subscription of it is
        retired."""
        clock = time.monotonic()
        if (
            self._recorded_at is None
            or clock - self._recorded_at >= HELD_REFRESH_SECONDS
            or subscriber.name not in self._recorded
        ):
            self._recorded = recorded_types(self.using)
            self._recorded_at = clock
        if subscriber.name not in self._recorded:
            return subscriber.event_types
        return self._recorded[subscriber.name]

    def rows_due(self, subscriber: Subscriber, now: datetime) -> bool:
        """Stream delivery: whether ``subscriber`` may have delivery rows due
        (failed attempts' retries, events set aside, operators' requeues and
        replays): the soonest due time of every subscriber's claimable rows,
        read at most once every :data:`HELD_REFRESH_SECONDS` (a row due
        meanwhile waits for the next reading, as a pause is seen)."""
        clock = time.monotonic()
        if self._due_read is None or clock - self._due_read >= HELD_REFRESH_SECONDS:
            self._due = dict(
                Delivery.objects.using(self.using)
                .filter(state__in=CLAIMABLE)
                .order_by()
                .values_list("subscriber")
                .annotate(Min("next_retry_at"))
            )
            self._due_read = clock
        due = [self._due[n] for n in subscriber.stored_names if n in self._due]
        return bool(due) and min(due) <= now

    def awaiting_fanout(self) -> bool:
        """Whether events wait for row delivery's fan-out (written by a writer
        of an earlier version, or with ``OUTBOX_ENGINE = "rows"``), read at
        most once every :data:`HELD_REFRESH_SECONDS`."""
        clock = time.monotonic()
        if self._fanout_read is None or clock - self._fanout_read >= (
            HELD_REFRESH_SECONDS
        ):
            self._awaiting = (
                OutboxEvent.objects.using(self.using).awaiting_fanout().exists()
            )
            self._fanout_read = clock
        return self._awaiting

    def cursors(self, worker: str) -> Cursors:
        """The stream cursors this relay holds (kept with the view)."""
        if self._cursors is None:
            self._cursors = Cursors(self.using, worker)
        return self._cursors

    def close(self) -> None:
        """Hand back the cursors held (a relay stopping, a call done)."""
        if self._cursors is not None:
            self._cursors.release()
            self._cursors = None

    def types(self, subscribers: Sequence[Subscriber]) -> frozenset[str] | None:
        """:func:`~outbox_app.relay.fanout.subscribed_types` of ``subscribers``,
        read again once a second has passed or the subscribers differ."""
        names, clock = tuple(s.name for s in subscribers), time.monotonic()
        if (
            self._read is None
            or self._read[0] != names
            or clock - self._read[1] >= HELD_REFRESH_SECONDS
        ):
            self._types = subscribed_types(subscribers, self.using)
            self._read = (names, clock)
        return self._types


def relay_once(
    *,
    kind: Kind | None = None,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    now: datetime | None = None,
    stop: threading.Event | None = None,
    view: SubscriptionView | None = None,
) -> RelayReport:
    """Fan out, then deliver what is due, once.

    Args:
        kind: ``"handler"`` or ``"publisher"`` to deliver to one kind only;
            ``None`` for both.
        using: database alias.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: time budget in seconds for the whole call; ``None``: until
            nothing is due.
        now: the clock for claims and backoff (tests); default the database's
            (:func:`~outbox_app.store.clock.database_now`).
        stop: when set (a relay shutting down), no new batch is claimed and the
            unattempted rows of the current handler batch are released.
        view: the paused subscribers and subscribed types, as a relay's loop
            keeps them (:class:`SubscriptionView`); default read afresh.

    Returns:
        RelayReport with the counts.
    """
    own_view = view is None
    view = view or SubscriptionView(using)
    try:
        return _relay_once(kind, using, batch_size, max_seconds, now, stop, view)
    finally:
        if own_view:
            view.close()


def _relay_once(kind, using, batch_size, max_seconds, now, stop, view) -> RelayReport:
    deadline = None if max_seconds is None else time.monotonic() + max_seconds

    def remaining() -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    options = {
        "kind": kind,
        "using": using,
        "batch_size": batch_size,
        "now": now,
        "view": view,
    }
    # Delivery fans out as it claims (unordered subscribers); what is left
    # (events only ordered subscribers, or subscribers of the other kind,
    # receive) is fanned out next, then delivered.
    report = deliver(max_seconds=remaining(), stop=stop, **options)
    fanned_out = 0
    if not streaming(using) or view.awaiting_fanout():
        fanned_out = fan_out(
            using=using,
            batch_size=batch_size,
            max_seconds=remaining(),
            types_of=view.types,
        )
    report.fanned_out += fanned_out
    if fanned_out and not (stop and stop.is_set()) and remaining() != 0:
        report += deliver(max_seconds=remaining(), stop=stop, **options)
    return report


def deliver(
    subscribers: Iterable[Subscriber] | None = None,
    *,
    kind: Kind | None = None,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    now: datetime | None = None,
    worker: str | None = None,
    rng: random.Random | None = None,
    stop: threading.Event | None = None,
    fold: bool = True,
    claim_ahead: bool = True,
    view: SubscriptionView | None = None,
    gateway: Gateway | None = None,
) -> RelayReport:
    """Claim and deliver due deliveries, batch by batch, until none is due or
    the time budget is spent.

    Subscribers take turns, a batch each; a call that ran out of time is
    followed by one that starts with the next subscriber, so one subscriber's
    backlog does not hold up the others even when its batches outlast
    ``max_seconds``. A publisher paused by an outage is
    skipped until its probe succeeds (and no batch is claimed ahead for it);
    a subscriber an operator paused is skipped until it is resumed
    (:class:`Held`: one query when the call starts, then at most one a
    second).
    With ``fold``, an unordered subscriber's batch that is not
    full is topped up from events not fanned out yet: fan-out and claim are
    one step (:meth:`Batch.claim <outbox_app.relay.batch.Batch.claim>`),
    creating deliveries for every active subscription (those of other
    relays' subscribers too, :mod:`~outbox_app.relay.fanout`); the
    subscribers whose claim came earlier in the turn claim again in it.

    Args:
        subscribers: whom to deliver for; default every subscriber of ``kind``.
        kind: ``"handler"``, ``"publisher"`` or ``None`` (both), when
            ``subscribers`` is not given.
        using: database alias.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop claiming new batches after this many seconds; ``None``
            runs until nothing is due. Batches already claimed are finished.
        now: the clock for claims, backoff and pauses (tests); default the
            database's (:func:`~outbox_app.store.clock.database_now`), read per batch.
        worker: lease holder name; default :func:`worker_name`.
        rng: randomness for backoff jitter (tests).
        stop: when set, claim no new batch; a handler batch releases the rows
            it has not attempted yet (due again at once, attempt taken back).
        fold: fan out while claiming (see above).
        claim_ahead: under a backlog (a full batch), claim the next batch on a
            second database connection while this one is delivered (PostgreSQL,
            MySQL/MariaDB, outside a transaction); False: each batch is
            claimed after the previous one, on the caller's connection.
        view: the paused subscribers and subscribed types, as a relay's loop
            keeps them (:class:`SubscriptionView`); default read afresh.
        gateway: the statements the batches send (claims, outcomes); default
            :class:`~outbox_app.store.gateway.Gateway` of ``using`` (a test
            may hand in a store of its own).

    Returns:
        RelayReport with the counts.

    Raises:
        django.db.DatabaseError: the database failed outside a delivery (during
            a claim); outcomes already written stay written.
    """
    chosen = list(registry.subscribers(kind) if subscribers is None else subscribers)
    names = [s.name for s in chosen]  # rotated: see the docstring
    if _next_first.get(using) in names:
        start = names.index(_next_first.pop(using))
        chosen = chosen[start:] + chosen[:start]
    own_view = view is None
    view = view or SubscriptionView(using)
    turns = _Turns(
        chosen,
        using=using,
        batch_size=batch_size or outbox_settings.BATCH_SIZE,
        now=now,
        worker=worker or worker_name(),
        rng=rng,
        stop=stop or threading.Event(),
        fold=fold,
        claim_ahead=claim_ahead,
        view=view,
        deadline=None if max_seconds is None else time.monotonic() + max_seconds,
        gateway=gateway or Gateway(using),
    )
    try:
        return turns.run()
    finally:
        # The batches in flight are collected; a batch claimed ahead and not
        # delivered (time is up, stopping, an error) is handed back.
        try:
            turns.close()
        finally:
            if own_view:
                view.close()


class _Turns:
    """One :func:`deliver` call: subscribers take turns, a batch each (their
    due rows, then their stream), until none has more or time is up."""

    def __init__(
        self,
        chosen: list[Subscriber],
        *,
        using: str,
        batch_size: int,
        now: datetime | None,
        worker: str,
        rng: random.Random | None,
        stop: threading.Event,
        fold: bool,
        claim_ahead: bool,
        view: SubscriptionView,
        deadline: float | None,
        gateway: Gateway,
    ):
        self.chosen = chosen
        self.using = using
        self.batch_size = batch_size
        self.now = now
        self.worker = worker
        self.rng = rng
        self.stop = stop
        self.claim_ahead = claim_ahead
        self.view = view
        self.deadline = deadline
        self.gateway = gateway
        self.report = RelayReport()
        self.ahead = ClaimAhead(using)
        self.cursors = view.cursors(worker) if streaming(using) else None
        self.runners = {
            s: PublisherRunner(s, using, rng)
            for s in chosen
            if isinstance(s, Publisher)
        }
        self.folding = None
        if fold:
            known = registry.subscribers()
            names = {s.name for s in known}
            known += [s for s in chosen if s.name not in names]
            types = view.types(known)  # records this relay's subscribers too
            if self.cursors is None or view.awaiting_fanout():
                self.folding = Fold(types)
        self.delivering = 0.0  # seconds the last batch took to deliver

    def claim(self, subscriber: Subscriber) -> Batch:
        return Batch.claim(
            subscriber,
            self.using,
            self.batch_size,
            self.now,
            self.worker,
            self.folding,
            self.gateway,
        )

    def clock(self) -> datetime:
        return self.now or database_now(self.using)

    def run(self) -> RelayReport:
        active = self.chosen
        while active:
            if self.cursors is not None:
                self.cursors.stream.turn()
            busy: list[Subscriber] = []
            for position, subscriber in enumerate(active):
                if self.stop.is_set():
                    return self.report
                if subscriber.name in self.view.held or not self.ready(subscriber):
                    continue
                began = time.monotonic()
                delivered = self.rows(subscriber, position, active, busy)
                # The subscriber's stream: a batch per cursor it holds.
                if self.cursors is not None and not self.stop.is_set():
                    delivered += self.stream(subscriber, busy)
                runner = self.runners.get(subscriber)
                if runner is not None:
                    runner.turn_done(self.clock(), self.using)
                self.delivering = time.monotonic() - began
                if delivered:
                    relay_metrics.batch(subscriber.name, self.delivering)
                if self.deadline is not None and time.monotonic() >= self.deadline:
                    _next_first[self.using] = active[(position + 1) % len(active)].name
                    return self.report
            active = busy
        return self.report

    def ready(self, subscriber: Subscriber) -> bool:
        """A publisher paused by an outage waits for its probe (its batch in
        flight is collected meanwhile)."""
        runner = self.runners.get(subscriber)
        if runner is None or pauses.ready(
            subscriber, self.clock(), self.using, self.rng
        ):
            return True
        runner.finish()
        return False

    def rows(
        self,
        subscriber: Subscriber,
        position: int,
        active: list[Subscriber],
        busy: list[Subscriber],
    ) -> int:
        """Claim and deliver one batch of ``subscriber``'s due rows (with
        stream delivery only when some may be due); note it in ``busy`` when
        more may follow. Returns the rows delivered."""
        if self.cursors is not None and not self.view.rows_due(
            subscriber, self.clock()
        ):
            return 0
        batch = self.ahead.take(subscriber) or self.claim(subscriber)
        report = self.report
        claimed = len(batch)
        report.fanned_out += batch.fanned_out
        if batch.fanned_out:
            # Rows for every subscriber: those claimed before this fan-out
            # look again this turn, not at the next wake-up.
            busy += [s for s in active[:position] if s not in busy]
        report.claimed += claimed
        lapsed = batch.take_lapsed()
        if lapsed:
            batch.outcomes(report).lapsed(lapsed)
        # A full batch (in rows, or in bytes) may have more behind it; so may
        # any batch of an ordered subscriber, which claims only each
        # aggregate's head.
        more = (
            claimed == self.batch_size
            or batch.near_budget()
            or (subscriber.ordered and claimed)
        )
        if more:
            busy.append(subscriber)
            # A backlog: claim the next batch on a second connection while
            # this one is delivered (unless time is up by then).
            following = active[position + 1 : position + 2] or busy
            if (
                self.claim_ahead
                and (
                    self.deadline is None
                    or time.monotonic() + self.delivering < self.deadline
                )
                and not pauses.paused(following[0].name)
                and following[0].name not in self.view.held
            ):
                self.ahead.submit(following[0], self.claim)
        runner = self.runners.get(subscriber)
        if runner is not None and (len(batch) or self.cursors is None):
            # An ordered publisher's next heads appear only once this batch
            # is marked: no window for it. (With streams, an empty claim
            # leaves the window to the stream's batch.)
            runner.deliver(batch, report, last=not more or subscriber.ordered)
        elif len(batch):
            assert isinstance(subscriber, Handler)
            run_handlers(batch, subscriber, batch.outcomes(report), self.stop, self.rng)
        return len(batch)

    def stream(self, subscriber: Subscriber, busy: list[Subscriber]) -> int:
        """Read and deliver one batch from each cursor of ``subscriber`` this
        relay holds (taking those that are free); note it in ``busy`` when
        more may follow. Returns the events delivered or set aside."""
        assert self.cursors is not None
        types = self.view.stream_types(subscriber)
        if types is not None and not types:  # retired: its cursor stays
            return 0
        taken = 0
        # Inside a caller's transaction (a test's), the events it wrote
        # itself are read on their own (StreamBatch.read_own).
        own = (
            self.cursors.stream.dialect.own_events() is not None
            and connections[self.using].in_atomic_block
        )
        runner = self.runners.get(subscriber)
        if runner is not None and self.cursors.may_hand_back(subscriber):
            runner.finish()
        for hold in self.cursors.of(subscriber, self.clock()):
            for read in (StreamBatch.read_own,) * own + (StreamBatch.read,):
                if self.stop.is_set():
                    return taken
                batch = read(
                    subscriber, hold, self.cursors, self.batch_size, self.now, types
                )
                taken += self.deliver_stream(subscriber, batch)
                # More in the tick, or (MySQL/MariaDB) after it, numbered
                # or waiting to be: a next tick.
                more = batch.more or self.cursors.stream.numbered_after(batch.tick)
                if more and subscriber not in busy:
                    busy.append(subscriber)
        return taken

    def deliver_stream(self, subscriber: Subscriber, batch: StreamBatch) -> int:
        """Deliver a stream ``batch`` to ``subscriber``. Returns the events
        delivered or set aside."""
        self.report.claimed += len(batch.contexts)
        runner = self.runners.get(subscriber)
        if runner is not None:
            last = not batch.more or subscriber.ordered
            runner.deliver(batch, self.report, last=last)
        else:
            assert isinstance(subscriber, Handler)
            outcomes = batch.outcomes(self.report)
            try:
                run_handlers(batch, subscriber, outcomes, self.stop, self.rng)
            except NotContiguous:
                # Read past where the cursor stands (a batch before it broke
                # off): its group rolled back, and is read again from there.
                outcomes.handed_back(len(batch.contexts))
        return len(batch)

    def close(self) -> None:
        for runner in self.runners.values():
            runner.close()
        self.report += self.ahead.close()
