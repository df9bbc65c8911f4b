"""Stream delivery: each subscriber reads the outbox through its cursors.

A cursor (:class:`~outbox_app.store.models.Cursor`) is one subscriber's place
in the outbox, one per partition of its events (a hash of the aggregate), held
by one relay at a time through a lease fenced by its token. A relay reads a
batch from a cursor it holds (:meth:`StreamBatch.read`: on PostgreSQL the
events whose transaction committed in the tick being read, in position order;
on SQLite the events after the last position read), delivers it, and moves
the cursor past it once it is delivered: for handlers in the transaction of
their writes, so a handler that only writes to the database takes effect
exactly once; for brokers once the broker confirmed. A subscriber that is up
to date writes one cursor row a batch and nothing per event.

What a batch does not deliver becomes a delivery row, written in the same
transaction that moves the cursor past it (the lifecycle's ``divert``): a
failed first attempt (FAILED, due after the backoff; DEAD when it was the
last or is never retried), an event whose ``expires_at`` passed (SKIPPED), an
event due later (PENDING, due at its ``deliver_at``), an event of a type this
relay's subscriber does not receive but a relay of another version does
(PENDING), and, for an ordered subscriber, an event of an aggregate that has
an unfinished row (PENDING behind it). Those rows are claimed, retried,
dead-lettered and requeued like every delivery row
(:mod:`~outbox_app.relay.batch`); an ordered subscriber's aggregate flows
from the stream again once its rows are finished.

A relay keeps the cursors it holds across its turns (:class:`Cursors`, in the
loop's :class:`~outbox_app.relay.loop.SubscriptionView`) and hands them back
when it stops. A paused subscriber's cursor does not move: its relay reads
nothing for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from django.db import DatabaseError, transaction

from ..conf import outbox_settings
from ..exceptions import LeaseLost
from ..execution.run import recorded_error
from ..store.clock import database_now
from ..store.gateway import Diverted, Gateway, Reading, Stream, streaming
from ..store.gateway import partitions as stream_partitions
from ..store.lifecycle import State
from ..store.models import Cursor
from ..subscribers import DeliveryContext, Subscriber
from .outcomes import LAPSED_ERROR, LAPSED_ERROR_TYPE, Outcomes, RelayReport

logger = logging.getLogger("outbox_app.relay")

__all__ = ["Cursors", "Hold", "StreamBatch", "streaming"]

#: How often a relay tries again to take the cursors of a subscriber that
#: other relays hold, in seconds.
TAKE_RETRY_SECONDS = 1.0
#: How long a cursor handed back to the relay that asked for it is left for
#: that relay before any relay may take it, in seconds.
PROMISE_SECONDS = 5 * TAKE_RETRY_SECONDS


@dataclass
class Hold:
    """A cursor this relay holds.

    Attributes:
        cursor_id: its row.
        partition, partitions: which slice of its subscriber's events.
        token: the lease token every move is fenced by.
        reading: what is delivered (ahead of the row, whose write may wait).
        ahead: where the next batch is read from, when batches read are not
            all delivered yet (a publisher's confirm window); None: from
            ``reading``.
        written: the reading as the row has it.
        renewed: ``time.monotonic()`` when the lease was last written.
        stop: where it stops (the subscriber's partitions are changing).
        own_after: the last position delivered of the events of a
            transaction that runs the relay itself (a test's).
        walk: the tick being read is large: read on by position.
        ticked: a tick was read to its end since the row was last written.
        wanted: another relay asked for it: handed over after this batch.
        lost: the lease passed to another relay; nothing more is written.
    """

    cursor_id: int
    subscriber: str
    partition: int
    partitions: int
    token: uuid.UUID
    reading: Reading
    written: Reading
    renewed: float
    stop: str | None = None
    own_after: int = 0
    ahead: Reading | None = None
    walk: bool = False
    ticked: bool = False
    wanted: bool = False
    lost: bool = False

    def lease_is_young(self) -> bool:
        """Less than a tenth of the lease has passed since it was written."""
        return time.monotonic() - self.renewed <= outbox_settings.LEASE_SECONDS / 10

    def lease_may_have_run_out(self) -> bool:
        return time.monotonic() - self.renewed >= outbox_settings.LEASE_SECONDS

    @property
    def drained(self) -> bool:
        """It stops, and has read to its stop."""
        return (
            self.stop is not None
            and self.reading.tick == self.stop
            and self.reading.next_tick is None
        )


class Cursors:
    """The cursors one relay holds on database ``using``, by subscriber name;
    a running relay keeps them across its turns.

    **Sharing.** A subscriber's partitions are shared by the relays that have
    it: each takes up to its fair share, the partitions divided by the relays
    holding a live lease on one (itself included). A relay short of its share
    takes free or expired cursors first, then asks for one of the relay
    holding the most (``wanted_by``) while that relay holds at least two more
    than it (so one cursor does not go to and fro between two relays); that
    relay sees the request when it
    next moves the cursor (its lease renewal, when idle) and hands it back
    after that batch, so a partition changes hands only between batches and
    its events stay in order. A relay holding more than its share hands the
    rest back.

    **Changing the partitions.** A relay whose ``partitions`` setting differs
    from the cursors' count, and that started after they were made (the
    newest setting wins), asks for every cursor of the old count; holding
    them all, it stops each at one tick (``stop_tick``, a snapshot taken then)
    and creates the cursors of the new count starting at that tick. The old
    cursors are read to the stop and deleted; the new ones are read only
    once no old one is left. Every event is read by exactly one cursor: those
    visible at the stop by the old ones, the others by the new ones.

    Args:
        using: database alias.
        worker: the lease holder's name.
    """

    def __init__(self, using: str, worker: str):
        self.using = using
        self.worker = worker
        self.stream = Stream(using)
        self.holds: dict[str, list[Hold]] = {}
        self._tried: dict[str, float] = {}
        # When this process first read the cursors: a change of partitions
        # is started only by a process newer than the cursors' count.
        self.started = _started.setdefault(using, database_now(using))

    def of(self, subscriber: Subscriber, now: datetime.datetime) -> list[Hold]:
        """The cursors of ``subscriber`` this relay reads now: those it holds
        of the generation being read (a changing subscriber's old cursors
        until they are drained), after handing back what another relay asked
        for or what is over its share, taking its share (at most once every
        :data:`TAKE_RETRY_SECONDS`) and creating the cursors where none
        exists yet. A lease older than half of ``OUTBOX_LEASE_SECONDS`` is
        renewed (writing the reading kept ahead of the row)."""
        name = subscriber.name
        holds = [h for h in self.holds.get(name, []) if not h.lost]
        for hold in holds:
            if time.monotonic() - hold.renewed >= outbox_settings.LEASE_SECONDS / 2:
                self.write(hold, now)
        for hold in holds:
            if hold.lost:
                continue
            if hold.drained:
                self._drop(hold)
            elif hold.wanted:
                self._release(hold, now)
        holds = [h for h in holds if not h.lost]
        clock = time.monotonic()
        if clock - self._tried.get(name, -TAKE_RETRY_SECONDS) >= TAKE_RETRY_SECONDS:
            self._tried[name] = clock
            holds = self._share(subscriber, holds, now)
            # An old cursor taken already drained (stopped where it stood: no
            # event came between its last read and the change) goes at once,
            # and the new count's are taken: a relay that holds its cursors
            # for one pass only (relay_once(), a Celery task) would otherwise
            # take and hand it back forever.
            drained = [h for h in holds if h.drained]
            for hold in drained:
                self._drop(hold)
            if drained:
                holds = self._share(subscriber, [h for h in holds if not h.lost], now)
        self.holds[name] = holds
        return holds

    def may_hand_back(self, subscriber: Subscriber) -> bool:
        """Whether :meth:`of` may hand back a cursor of ``subscriber`` now
        (another relay asked for it, it is drained, or the share is looked at
        again): a batch sent from it and not recorded yet is recorded first,
        or the next holder would send it again."""
        holds = [h for h in self.holds.get(subscriber.name, []) if not h.lost]
        due = self._tried.get(subscriber.name, -TAKE_RETRY_SECONDS) + TAKE_RETRY_SECONDS
        return bool(holds) and (
            any(h.wanted or h.drained for h in holds) or time.monotonic() >= due
        )

    def _share(
        self, subscriber: Subscriber, holds: list[Hold], now: datetime.datetime
    ) -> list[Hold]:
        """This relay's share of ``subscriber``'s cursors being read: the
        old count's while a change of its partitions drains them, else the
        current count's. Hands back what is over the share, takes free
        cursors up to it, asks for the rest, and starts a change of the
        partitions where this relay's setting is the newest."""
        rows = Cursor.objects.using(self.using).filter(subscriber=subscriber.name)
        found = list(rows.order_by("partitions", "partition"))
        if not found:
            Cursor.objects.using(self.using).ensure([subscriber])
            found = list(rows.order_by("partitions", "partition"))
        draining = [c for c in found if c.stop_tick is not None]
        current = draining or found
        ids = {c.id for c in current}
        configured = stream_partitions(subscriber, self.using)
        changing = bool(
            current
            and not draining
            and current[0].partitions != configured
            and max(c.created_at for c in current) < self.started
        )
        mine = [h for h in holds if h.cursor_id in ids]
        for hold in holds:
            if hold.cursor_id not in ids:  # deleted meanwhile
                hold.lost = True
        held = {h.cursor_id for h in mine}
        others = {c.locked_by for c in current if c.id not in held and _leased(c, now)}
        share = len(current) if changing else -(-len(current) // (len(others) + 1))
        for hold in mine[share:]:
            self._release(hold, now)
        mine = mine[:share]
        for cursor in current:
            if len(mine) >= share:
                break
            if (
                cursor.id not in held
                and not _leased(cursor, now)
                and not self._promised(cursor, now)
            ):
                hold = self._take(cursor, now)
                if hold is not None:
                    mine.append(hold)
        if len(mine) < share:
            taken = {h.cursor_id for h in mine}
            self._ask(current, taken, now, share - len(mine), changing)
        elif changing:
            # LeaseLost: another relay took one of them meanwhile (its next
            # write finds out which); the count changes at a later turn.
            with contextlib.suppress(LeaseLost):
                self._change(subscriber, mine, current, configured, now)
        return mine

    def _promised(self, cursor: Cursor, now: datetime.datetime) -> bool:
        """Whether ``cursor``, free, was handed back to the relay that asked
        for it, and is left for it a while (:data:`PROMISE_SECONDS`)."""
        return (
            cursor.wanted_by not in ("", self.worker[:255])
            and (now - cursor.updated_at).total_seconds() < PROMISE_SECONDS
        )

    def _take(self, cursor: Cursor, now: datetime.datetime) -> Hold | None:
        token = uuid.uuid4()
        found = self.stream.take(
            cursor.id, token=token, worker=self.worker, expiry=_expiry(now), now=now
        )
        if found is None:
            return None
        reading, stop, own_after = found
        return Hold(
            cursor.id,
            cursor.subscriber,
            cursor.partition,
            cursor.partitions,
            token,
            reading,
            reading,
            time.monotonic(),
            stop=stop,
            own_after=own_after,
        )

    def _ask(self, current, mine, now, wanting: int, all_of_them: bool) -> None:
        """Ask for ``wanting`` cursors of ``current`` that other relays hold
        (those of the relay holding the most first; every one when
        ``all_of_them``)."""
        held: dict[str, list[Cursor]] = {}
        for cursor in current:
            if cursor.id not in mine and _leased(cursor, now):
                held.setdefault(cursor.locked_by, []).append(cursor)
        rows = Cursor.objects.using(self.using)
        for owner in sorted(held, key=lambda o: -len(held[o])):
            asked = 0
            for cursor in held[owner]:
                # Short of a fair share by a remainder only (one cursor, two
                # relays): asking would hand it to and fro.
                even = len(held[owner]) - asked <= len(mine) + asked + 1
                if wanting <= 0 or (even and not all_of_them):
                    return
                if cursor.wanted_by in ("", self.worker):
                    rows.filter(id=cursor.id, wanted_by="").update(
                        wanted_by=self.worker[:255]
                    )
                    wanting -= 1
                    asked += 1
            if not all_of_them:
                return

    def _change(
        self,
        subscriber: Subscriber,
        holds: list[Hold],
        current: list[Cursor],
        partitions: int,
        now: datetime.datetime,
    ) -> list[Hold]:
        """Holding every cursor of ``subscriber``'s current count, stop them
        all at one tick taken now and create ``partitions`` cursors starting
        there (see the class docstring).

        Raises:
            LeaseLost: another relay took one of them meanwhile (nothing is
                written).
        """
        tick, _ = self.stream.first_reading(False)
        rows = Cursor.objects.using(self.using)
        stopping = [hold for hold in holds if hold.stop is None]
        with transaction.atomic(using=self.using):
            for hold in stopping:
                if not rows.filter(id=hold.cursor_id, lease_token=hold.token).update(
                    stop_tick=tick
                ):
                    raise LeaseLost("a cursor of the old count was taken over")
            first = current[0]
            rows.bulk_create(
                Cursor(
                    subscriber=subscriber.name,
                    partition=partition,
                    partitions=partitions,
                    tick=tick,
                    first_tick=first.first_tick,
                    first_position=first.first_position,
                    created_at=now,
                    updated_at=now,
                )
                for partition in range(partitions)
            )
        for hold in stopping:
            hold.stop = tick
        logger.info(
            "%s: partitions %d -> %d: the %d cursors are read to tick %s, then "
            "the new ones go on from there",
            subscriber.name,
            current[0].partitions,
            partitions,
            len(current),
            tick,
        )
        return holds

    def _drop(self, hold: Hold) -> None:
        """Delete a drained cursor (fenced by its lease)."""
        Cursor.objects.using(self.using).filter(
            id=hold.cursor_id, lease_token=hold.token
        ).delete()
        hold.lost = True

    def _release(self, hold: Hold, now: datetime.datetime) -> None:
        """Hand ``hold`` back with its reading (another relay asked for it,
        or this relay holds more than its share)."""
        try:
            self.stream.release(
                hold.cursor_id, hold.token, hold.reading, now=now, ticked=hold.ticked
            )
        finally:
            hold.lost = True

    def write(self, hold: Hold, now: datetime.datetime) -> bool:
        """Write ``hold``'s reading and renew its lease; False (and the hold
        dropped) when the lease was lost. Notes whether another relay asked
        for it."""
        if hold.lost:
            return False
        renewed = time.monotonic()
        wanted = self.stream.move(
            hold.cursor_id,
            hold.token,
            hold.reading,
            expiry=_expiry(now),
            now=now,
            ticked=hold.ticked,
        )
        if wanted is None:
            hold.lost = True
            return False
        hold.written, hold.renewed, hold.ticked = hold.reading, renewed, False
        hold.wanted = bool(wanted) and wanted != self.worker
        return True

    def release(self) -> None:
        """Hand every cursor back with its reading (a relay stopping, a
        Celery task done), so another relay takes it at once; best effort: a
        cursor that cannot be written is taken over once its lease runs
        out."""
        now = database_now(self.using)
        for holds in self.holds.values():
            for hold in holds:
                if hold.lost:
                    continue
                try:
                    self._release(hold, now)
                except DatabaseError:
                    logger.warning(
                        "%s: could not hand back cursor %s",
                        hold.subscriber,
                        hold.cursor_id,
                        exc_info=True,
                    )
        self.holds.clear()


#: database alias -> when this process first read its cursors (the
#: database's clock).
_started: dict[str, datetime.datetime] = {}


def _leased(cursor: Cursor, now: datetime.datetime) -> bool:
    """Whether a relay holds ``cursor`` (a row read) by a lease not run out."""
    return (
        cursor.lease_token is not None
        and cursor.locked_until is not None
        and cursor.locked_until > now
    )


def _expiry(now: datetime.datetime) -> datetime.datetime:
    return now + datetime.timedelta(seconds=outbox_settings.LEASE_SECONDS)


@dataclass
class _Aside:
    """An event of a batch that is not delivered now, and its row."""

    position: int
    context: DeliveryContext
    row: Diverted
    written: bool = False


@dataclass
class StreamBatch:
    """One batch read from a cursor: the events to deliver now
    (``contexts``, in position order) and those set aside as delivery rows.

    Attributes:
        subscriber: whose cursor it is.
        hold: the cursor.
        tick: the tick read (PostgreSQL), kept as the cursor's next tick.
        contexts: the events to deliver now.
        aside: the events passed without delivering them, each with its row.
        last: the last position read (the cursor moves past it once every
            event of the batch is delivered or set aside).
        more: events may follow in the same tick.
        now: the read's clock; :meth:`clock` moves it on.
        held: the aggregates of an ordered subscriber set aside in this batch
            (their later events in it wait behind them too).
    """

    subscriber: Subscriber
    hold: Hold
    cursors: Cursors
    tick: str | None
    contexts: list[DeliveryContext]
    aside: list[_Aside]
    last: int
    more: bool
    now: datetime.datetime
    started: float
    held: set[tuple[str, str]] = field(default_factory=set)
    fanned_out: int = 0
    payload_bytes: int = 0
    start: Reading | None = None
    settled: Reading | None = None
    end: Reading | None = None
    own: bool = False

    @classmethod
    def read(
        cls,
        subscriber: Subscriber,
        hold: Hold,
        cursors: Cursors,
        batch_size: int,
        now: datetime.datetime | None,
        event_types: frozenset[str] | None,
    ) -> StreamBatch:
        """Read the next batch of ``hold`` for ``subscriber``: up to
        ``batch_size`` events of ``event_types`` (those some active
        subscription of the subscriber receives, whichever relay recorded
        it; None: every type) whose payloads add up to at most
        ``OUTBOX_BATCH_BYTES``. Sets aside, as rows, what is not delivered
        now (see the module docstring)."""
        started = time.monotonic()
        using = cursors.using
        now = now or database_now(using)
        # After a batch sent and not confirmed yet, the next one is read
        # from where that one ends.
        start = hold.ahead or hold.reading
        reading = start
        if hold.stop is not None and reading.next_tick is None:
            # A cursor that stops reads its last tick up to the stop (none
            # when it is there: drained, it is deleted at the next turn).
            if reading.tick == hold.stop:
                return cls(
                    subscriber, hold, cursors, None, [], [], 0, False, now, started,
                    start=start, settled=start, end=start,
                )  # fmt: skip
            reading = Reading(reading.tick, hold.stop, reading.position)
        found = cursors.stream.read(
            subscriber.name,
            reading,
            event_types=event_types,
            partitions=hold.partitions,
            partition=hold.partition,
            held=subscriber.stored_names if subscriber.ordered else None,
            limit=batch_size,
            max_bytes=outbox_settings.BATCH_BYTES,
            walk=hold.walk,
        )
        batch = cls(
            subscriber,
            hold,
            cursors,
            found.tick,
            [],
            [],
            start.position,
            found.more,
            now,
            started,
            start=start,
            settled=start,
        )
        if found.more and start.next_tick is None:
            # A large tick: its first batch came sorted from the transaction
            # id index; the rest is read on in position order.
            hold.walk = True
        for streamed in found.events:
            batch._take(streamed.context, streamed.held)
        batch.payload_bytes = sum(c.payload_bytes for c in batch.contexts)
        batch.end = hold.ahead = batch.reading_to(batch.last, finished=not found.more)
        return batch

    @classmethod
    def read_own(
        cls,
        subscriber: Subscriber,
        hold: Hold,
        cursors: Cursors,
        batch_size: int,
        now: datetime.datetime | None,
        event_types: frozenset[str] | None,
    ) -> StreamBatch:
        """Read the events the reading transaction itself wrote, after the
        last of them delivered (a relay run inside a caller's transaction,
        as a test's, where a tick counts its own transaction as committed:
        its events written after a tick would be taken as read). Their
        batch moves no cursor: the position read is kept in the cursor's
        row within that transaction (``own_position``)."""
        started = time.monotonic()
        now = now or database_now(cursors.using)
        start = Reading(None, None, hold.own_after)
        found = cursors.stream.read(
            subscriber.name,
            start,
            event_types=event_types,
            partitions=hold.partitions,
            partition=hold.partition,
            held=subscriber.stored_names if subscriber.ordered else None,
            limit=batch_size,
            max_bytes=outbox_settings.BATCH_BYTES,
            own=True,
        )
        batch = cls(
            subscriber,
            hold,
            cursors,
            None,
            [],
            [],
            start.position,
            found.more,
            now,
            started,
            start=start,
            settled=start,
            own=True,
        )
        for streamed in found.events:
            batch._take(streamed.context, streamed.held)
        batch.payload_bytes = sum(c.payload_bytes for c in batch.contexts)
        batch.end = start
        return batch

    def reading_to(self, upto: int, *, finished: bool) -> Reading:
        """The cursor's reading once this batch is delivered up to position
        ``upto`` (``finished``: to its end, with nothing left in the tick)."""
        if self.tick is None:  # a position alone
            return Reading(None, None, upto)
        if finished:
            return Reading(self.tick, None, 0)
        return Reading(self.start.tick, self.tick, upto)

    def _take(self, context: DeliveryContext, held: bool) -> None:
        position = context.position
        assert position is not None
        self.last = position
        aggregate = (
            None
            if context.aggregate_type is None or context.aggregate_id is None
            else (context.aggregate_type, context.aggregate_id)
        )
        ordered = self.subscriber.ordered and aggregate is not None
        if context.expires_at is not None and context.expires_at <= self.now:
            self._set_aside(
                context,
                Diverted(
                    context.event_id,
                    State.SKIPPED,
                    0,
                    self.now,
                    last_error=LAPSED_ERROR,
                    last_error_type=LAPSED_ERROR_TYPE,
                    completed_at=self.now,
                ),
            )
            return
        waits = ordered and (held or aggregate in self.held)
        if not self.subscriber.receives(context.event_type) or waits:
            # Another version's subscriber receives it, or it waits behind
            # its aggregate's unfinished row: a row due now.
            self._hold(context, self.now, aggregate if ordered else None)
        elif context.deliver_at is not None and context.deliver_at > self.now:
            self._hold(context, context.deliver_at, aggregate if ordered else None)
        else:
            self.contexts.append(context)

    def _hold(self, context, due, aggregate) -> None:
        self._set_aside(context, Diverted(context.event_id, State.PENDING, 0, due))
        if aggregate is not None:
            self.held.add(aggregate)

    def _set_aside(self, context: DeliveryContext, row: Diverted) -> None:
        assert context.position is not None
        self.aside.append(_Aside(context.position, context, row))

    # --- the batch protocol the runners use (as relay.batch.Batch) -------------

    @property
    def gateway(self) -> Gateway:
        return Gateway(self.cursors.using)

    def outcomes(self, report: RelayReport) -> Outcomes:
        """Where this batch's outcomes are counted and logged (the rows it
        writes are fenced by the cursor's lease, not a row's)."""
        return Outcomes(self.gateway, self.subscriber, None, report)

    def __len__(self) -> int:
        return len(self.contexts) + len(self.aside)

    def near_budget(self) -> bool:
        return False

    def take_lapsed(self) -> list[DeliveryContext]:
        return []

    def clock(self) -> datetime.datetime:
        return self.now + datetime.timedelta(seconds=time.monotonic() - self.started)

    def lease_may_have_run_out(self) -> bool:
        return self.hold.lease_may_have_run_out()

    def keep(self, contexts: Sequence[DeliveryContext]) -> list[DeliveryContext]:
        """``contexts`` while this relay holds the cursor (its lease renewed
        once a tenth of it has passed); none once the lease was lost."""
        if self.hold.lost:
            return []
        if self.hold.lease_is_young() or not contexts:
            return list(contexts)
        return list(contexts) if self.cursors.write(self.hold, self.clock()) else []

    def release(self) -> RelayReport:
        """Nothing to hand back: the cursor moved past what was delivered."""
        return RelayReport(claimed=len(self))

    def settlement(self, outcomes: Outcomes) -> StreamSettlement:
        return StreamSettlement(self, outcomes)

    def aside_waiting(self) -> bool:
        return any(not a.written for a in self.aside)


class StreamSettlement:
    """Writes what happened to a :class:`StreamBatch`: the rows of the events
    passed without delivery and the cursor's move past them, in one
    transaction fenced by the cursor's lease, and counts and logs it in
    ``outcomes`` (its report and metrics). The runners call the same methods
    of a row batch's settlement (:class:`~outbox_app.relay.batch.RowSettlement`).
    """

    def __init__(self, batch: StreamBatch, outcomes: Outcomes):
        self.batch = batch
        self.outcomes = outcomes
        self.stream = batch.cursors.stream
        self.deferred_token = uuid.uuid4()
        self.ended = False
        # What a move inside a caller's transaction changed, to undo when
        # that transaction does not commit.
        self._undo: tuple | None = None

    def skip(self, context: DeliveryContext) -> bool:
        """Whether ``context`` waits behind an earlier event of its aggregate
        set aside in this batch (an ordered subscriber): it is set aside too,
        PENDING, due now."""
        batch = self.batch
        if not batch.subscriber.ordered or context.aggregate_id is None:
            return False
        aggregate = (context.aggregate_type, context.aggregate_id)
        if aggregate not in batch.held:
            return False
        batch._hold(context, batch.clock(), aggregate)
        return True

    def hold(self, context: DeliveryContext) -> None:
        """``context`` failed, or its handler's callbacks run after the
        commit: for an ordered subscriber, its aggregate's later events in
        this batch are set aside behind its row."""
        if self.batch.subscriber.ordered and context.aggregate_id is not None:
            self.batch.held.add((context.aggregate_type, context.aggregate_id))

    def group(
        self,
        succeeded: list[DeliveryContext],
        failures: list,
        deferred: list[DeliveryContext],
        last: DeliveryContext | None,
        *,
        inside: bool,
        fence_deferred: bool = False,
        end: bool = False,
    ) -> tuple[list, list[DeliveryContext]]:
        """A handler group's outcome: the rows of its failures and of its
        handlers with callbacks (RUNNING under :attr:`deferred_token`), and
        the cursor moved past ``last`` (``end``: past the batch), in its
        transaction when ``inside``, else in one of its own; its successes
        counted. Returns the failures written and the deferred contexts with
        their rows' ids.

        Raises:
            LeaseLost: the cursor passed to another relay (the caller rolls
                the group back).
        """
        upto = self.batch.last if end or last is None else last.position
        written, later = self.settle(upto, failures, deferred, end=end, inside=inside)
        self.outcomes.delivered(succeeded, self.outcomes.now())
        return written, later

    def recorded(self, failures) -> None:
        """The group's transaction committed: its move stays (a later group
        that breaks undoes only its own). Count and log ``failures`` as
        :meth:`settle` wrote them."""
        self._undo = None
        for context, error, retry_at, error_type in failures:
            self.outcomes.failure(context, error, retry_at, error_type)

    def abandoned(self, failures) -> None:
        """The group's transaction is gone, and with it its rows and the
        cursor's move: the cursor is where it was, its events are read
        again."""
        hold = self.batch.hold
        if self._undo is not None:
            hold.reading, hold.written, hold.ticked, aside = self._undo
            for a in aside:
                a.written = False
            self._undo = None
        # The next batch is read from where the cursor stands, not from
        # where this one's reading ahead had got to.
        self.batch.settled = hold.reading
        hold.ahead = None

    def lost(self, held: list[DeliveryContext]) -> None:
        """A group rolled back because the cursor's lease was lost: the
        relay that holds it now delivers them."""
        self.batch.hold.lost = True
        self.outcomes.lost(len(held), "ran in a rolled-back group")

    def stopped(self, waiting: list[DeliveryContext]) -> None:
        """The relay stops: the cursor stays before the events not attempted
        yet."""
        self.ended = True
        self.batch.hold.ahead = None

    def finish(self) -> None:
        """Move the cursor past the whole batch, writing the rows of the
        events set aside, if no group did (a batch with nothing to deliver
        now, or whose last event was set aside)."""
        batch, hold = self.batch, self.batch.hold
        if self.ended or hold.lost:
            return
        settled = batch.last == batch.settled.position and not batch.aside_waiting()
        if batch.own:
            if settled:
                return
        elif hold.reading != batch.settled:  # a batch before stopped short
            hold.ahead = None
            return
        elif settled:
            if not batch.more and batch.tick is not None:
                # Nothing left in the tick: the next read takes a new one
                # (the row is written with the next move, or the lease).
                hold.reading = batch.settled = batch.end
                hold.ticked = True
                hold.walk = False
            if hold.ahead == hold.reading:
                hold.ahead = None
            return
        try:
            self.settle(batch.last, [], [], end=True)
        except LeaseLost:  # the relay that holds the cursor now reads them
            hold.lost = True

    def deferred_outcomes(self) -> Outcomes:
        """The outcomes of the RUNNING rows written for handlers whose
        callbacks run after the commit (fenced by their own lease token)."""
        return Outcomes(
            self.outcomes.gateway,
            self.outcomes.subscriber,
            self.deferred_token,
            self.outcomes.report,
        )

    def sent(
        self,
        delivered: list[DeliveryContext],
        outages: list[DeliveryContext],
        failures: list,
        mark,
    ) -> None:
        """A publisher's send of this batch came back: the cursor moves past
        it, with the rows of its failures, or, when the destination was
        unreachable for some (``outages``), only up to the first of them
        (what follows is sent again once it is back)."""
        if not (delivered or outages or failures):
            self.finish()
            return
        try:
            self._sent(delivered, outages, failures)
        except NotContiguous:
            # Sent again once the cursor gets there (at least once).
            self.outcomes.handed_back(len(self.batch.contexts))
        except LeaseLost:
            # Sent; the relay that holds the cursor now sends them again.
            self.batch.hold.lost = True
            self.outcomes.lost(len(self.batch.contexts), "were sent")

    def _sent(self, delivered, outages, failures) -> None:
        if outages:
            stop = min(c.position for c in outages)
            upto = max(
                [self.batch.settled.position]
                + [p for p in self._positions() if p < stop]
            )
            failures = [f for f in failures if f[0].position < stop]
            delivered = [c for c in delivered if c.position < stop]
            written, _ = self.settle(upto, failures, [], end=False)
            self.batch.hold.ahead = None  # read again from the first outage
            self.outcomes.handed_back(
                sum(1 for c in self.batch.contexts if c.position >= stop)
            )
        else:
            written, _ = self.settle(self.batch.last, failures, [], end=True)
        self.outcomes.delivered(delivered, self.outcomes.now())
        self.recorded(written)

    def _positions(self) -> list[int]:
        batch = self.batch
        return [c.position for c in batch.contexts] + [a.position for a in batch.aside]

    def settle(
        self,
        upto: int,
        failures: list,
        deferred: list[DeliveryContext],
        *,
        end: bool,
        inside: bool = False,
    ) -> tuple[list, list[DeliveryContext]]:
        """Write the rows of ``failures`` (``(context, error, retry_at)``:
        FAILED due then, DEAD when None), of ``deferred`` (RUNNING, leased
        under :attr:`deferred_token`) and of the events set aside up to
        position ``upto``, and move the cursor past ``upto`` (``end``: past
        the whole batch, which finishes its tick when nothing follows in
        it): in the caller's transaction when ``inside``, else in one
        transaction of its own.

        Returns:
            The failures as written (each with its row's id and the error
            type recorded) and the deferred contexts with their rows' ids.

        Raises:
            LeaseLost: the cursor passed to another relay (nothing may
                commit).
        """
        batch, hold = self.batch, self.batch.hold
        if hold.lost:
            raise LeaseLost("the cursor's lease passed to another relay")
        if end:
            upto = batch.last
        if not batch.own and hold.reading != batch.settled:
            # A batch before this one stopped short (an outage): the cursor
            # is not where this one began, and stays where it is.
            hold.ahead = None
            raise NotContiguous
        # The lease follows the batch's clock (a test's, or the database's);
        # the rows are stamped with the database's.
        now, stamp = batch.clock(), self.outcomes.now()
        expiry = _expiry(now)
        rows = [_failed(batch, c, e, r, stamp) for c, e, r in failures]
        aside = [a for a in batch.aside if not a.written and a.position <= upto]
        leased = [
            Diverted(
                c.event_id,
                State.RUNNING,
                1,
                expiry,
                locked_until=expiry,
                locked_by=batch.cursors.worker,
                lease_token=self.deferred_token,
            )
            for c in deferred
        ]
        finished = end and not batch.more and not batch.own
        if batch.own or batch.tick is None:  # a position alone
            reading = Reading(None, None, upto)
        elif finished:
            reading = Reading(batch.tick, None, 0)
        else:
            reading = Reading(hold.reading.tick, batch.tick, upto)
        name = batch.subscriber.name
        self._undo = (hold.reading, hold.written, hold.ticked, aside)
        # A move alone is one statement: no transaction of its own around it
        # (two round trips fewer a batch).
        alone = not (rows or aside or leased or batch.own)
        try:
            with (
                contextlib.nullcontext()
                if alone
                else transaction.atomic(using=batch.cursors.using, savepoint=not inside)
            ):
                failed_ids = self.stream.divert(name, rows, stamp, returning=True)
                self.stream.divert(name, [a.row for a in aside], stamp)
                leased_ids = self.stream.divert(name, leased, stamp, returning=True)
                if batch.own:
                    moved = self.stream.own(hold.cursor_id, hold.token, upto)
                    hold.lost = not moved
                else:
                    hold.reading = reading
                    hold.ticked = hold.ticked or finished
                    moved = batch.cursors.write(hold, now)
                if not moved:
                    raise LeaseLost("the cursor's lease passed to another relay")
        except BaseException:
            self.abandoned([])
            raise
        for a in aside:
            a.written = True
        batch.settled = reading
        if batch.own:
            hold.own_after = upto
        elif hold.ahead == reading:
            hold.ahead = None
        if not inside:
            self._undo = None
        if finished:
            hold.walk = False
        if end:
            self.ended = True
        self.outcomes.skipped(sum(1 for a in aside if a.row.state == State.SKIPPED))
        written = [
            (dataclasses.replace(c, delivery_id=i), e, r, row.last_error_type)
            for (c, e, r), i, row in zip(failures, failed_ids, rows, strict=True)
        ]
        later = [
            dataclasses.replace(c, delivery_id=i)
            for c, i in zip(deferred, leased_ids, strict=True)
            if i is not None
        ]
        return written, later


class NotContiguous(Exception):
    """A batch's outcome arrives after one before it stopped short."""


def _failed(
    batch: StreamBatch,
    context: DeliveryContext,
    error: BaseException,
    retry_at: datetime.datetime | None,
    now: datetime.datetime,
) -> Diverted:
    """The row of a failed first attempt: FAILED due at ``retry_at``, or DEAD
    when it is None; an ordered subscriber's later events of its aggregate
    in the batch wait behind it."""
    message, error_type, text = recorded_error(error)
    if batch.subscriber.ordered and context.aggregate_id is not None:
        batch.held.add((context.aggregate_type, context.aggregate_id))
    dead = retry_at is None
    return Diverted(
        context.event_id,
        State.DEAD if dead else State.FAILED,
        context.attempt,
        now if dead else retry_at,
        last_error=message,
        last_error_type=error_type,
        last_traceback=text,
        first_failed_at=now,
        completed_at=now if dead else None,
    )
