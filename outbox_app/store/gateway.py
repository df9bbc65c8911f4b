"""The relay's SQL, run: every statement of the delivery hot path is sent from
here.

Fan-out, claim, renew, succeed, fail and release are named statements whose
text the database's dialect builds (:mod:`outbox_app.store.sql`: what the
databases share in ``base.py``, what differs in ``postgresql.py``,
``mysql.py`` and ``sqlite.py``), once per process and database (their text
depends only on the database and on how many values a list holds). They are
sent through the DB-API cursor with parameters; rows come back as tuples and
become :class:`~outbox_app.subscribers.DeliveryContext` values, never model
instances. This module is the only place the relay's SQL is sent from; the
ORM keeps the cold paths (admin, operations, status, purge).

Where the database allows it a step is one round trip:

==========  ================================  ================================
statement   PostgreSQL                        MySQL/MariaDB; SQLite
==========  ================================  ================================
fan-out     one ``WITH``: lock a batch of     the same statements in one
            events awaiting fan-out (``SKIP        transaction (SQLite: no locks;
            LOCKED``), insert their           one writer at a time)
            deliveries, flip the flag;
            with a lease, claim one
            subscriber's share and read it
claim       one ``WITH``: ``UPDATE ...        MariaDB: lock, update, read in
            RETURNING`` joined to the         one transaction; SQLite:
            events, payload included          ``UPDATE ... RETURNING id``, then
                                              read by primary key
outcomes    one ``UPDATE`` each, compare-and-set on the batch's lease token
==========  ================================  ================================

The statements' shape (one statement, or several in one transaction) is read
off the dialect's flags (``writable_cte``, ``update_returning``); the state
names come from :mod:`outbox_app.store.lifecycle`.
"""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from django.db import connections, transaction

from ..conf import outbox_settings
from ..subscribers import DeliveryContext
from .clock import database_now
from .db import reissued_on_deadlock
from .lifecycle import State
from .sql import Dialect, dialect
from .tables import EVENT_COLUMNS

#: No byte budget: larger than any batch's payloads.
UNBOUNDED = 2**62
#: How many events a relay numbers at most in one go (MySQL/MariaDB's stream
#: delivery): a tick holds about as many.
NUMBER_LIMIT = 1000


@dataclass(frozen=True)
class FannedOut:
    """What one fan-out step did.

    Attributes:
        scanned: the ids of the events it took, in id order (keyset paging
            goes on after the last; fewer than the limit: none is left).
        fanned_out: how many of them it marked fanned out (``fanned_out``):
            those with a delivery of an active subscription. The others
            (their only subscription was retired as the step ran) stay
            awaiting fan-out.
        contexts: the rows claimed for the lease's subscriber, in
            delivery id order.
    """

    scanned: list[uuid.UUID]
    fanned_out: int
    contexts: list[DeliveryContext]


@dataclass(frozen=True)
class Lease:
    """Who claims what fan-out creates for subscriber ``name``: the lease
    token, the worker and the lease's expiry (see :meth:`Gateway.fan_out`);
    and the bytes of payload the claim may still take (``max_bytes``), and
    whether it takes its first event even when that is larger
    (``at_least_one``: the batch is empty so far)."""

    name: str
    token: uuid.UUID
    worker: str
    expiry: datetime.datetime
    max_bytes: int = UNBOUNDED
    at_least_one: bool = True


def _reissued_on_deadlock(step):
    """A :class:`Gateway` step, its own transaction, run again when it was a
    deadlock victim (:func:`outbox_app.store.db.reissued_on_deadlock`)."""

    @functools.wraps(step)
    def run(self, *args, **kwargs):
        return reissued_on_deadlock(
            self.using,
            functools.partial(step, self, *args, **kwargs),
            f"relay {step.__name__}",
        )

    return run


class Gateway:
    """The statements of the relay on database ``using``.

    Each method is one step of delivery and says what it sends. Methods that
    change several rows run in one short transaction (``atomic``), so no lock
    outlives them; none keeps a transaction open for the caller.
    """

    def __init__(self, using: str = "default"):
        self.using = using

    @property
    def dialect(self) -> Dialect:
        return dialect(self.using)

    def now(self) -> datetime.datetime:
        """The database's clock (:func:`~outbox_app.store.clock.database_now`),
        which outcomes are stamped with."""
        return database_now(self.using)

    def _cursor(self):
        return self.dialect.cursor(connections[self.using])

    # --- fan-out ------------------------------------------------------------------

    @_reissued_on_deadlock
    def fan_out(
        self,
        types: frozenset[str] | None,
        limit: int,
        after: uuid.UUID | None,
        now: datetime.datetime,
        lease: Lease | None = None,
    ) -> FannedOut:
        """Turn up to ``limit`` events awaiting fan-out of ``types`` (``None``:
        every type; ids after ``after``, oldest first) into one delivery
        per active subscription of their type (:class:`~outbox_app.store.models.
        Subscription`, read by the same statement or transaction, so a
        subscription recorded before an event committed is never missed), due
        at ``now``, and flip the ``fanned_out`` flag of those that have a
        delivery. An event whose every subscription was retired since
        ``types`` was read gets none and waits for fan-out (it is counted as
        waiting for fan-out, and a subscription recorded later receives it).

        Events another relay is fanning out right now are skipped, never
        waited for (``SKIP LOCKED``): a relay frozen inside fan-out holds its
        own batch and nothing else. Ordered delivery does not depend on the
        order deliveries appear in (the claim waits for an aggregate's
        earlier events that are not fanned out yet), so skipping is safe.
        An existing ``(event, subscriber)`` pair is left alone.

        With ``lease``, fan-out and claim are one step: the deliveries of
        ``lease.name`` (an unordered subscriber) are created RUNNING, leased
        as :meth:`claim` leases them, and returned ready to deliver, event
        payload included; the others are PENDING. One statement on
        PostgreSQL, one transaction elsewhere. The batch is then the first
        events whose payloads add up to at most ``lease.max_bytes`` (and the
        first event alone, however large, with ``lease.at_least_one``); the
        rest wait for the next step.

        Returns:
            :class:`FannedOut`.
        """
        d = self.dialect
        select: list = [] if types is None else sorted(types)
        if after is not None:
            select.append(d.uuid_param(after))
        select.append(limit)
        claiming = lease is not None
        if claiming:
            select += [lease.max_bytes, int(lease.at_least_one)]
        subs = [lease.name] if claiming else []
        stamp = d.datetime_param(now)
        if claiming:
            until = d.datetime_param(lease.expiry)
            worker, token = lease.worker[:255], d.uuid_param(lease.token)
            values = [until, stamp, until, worker, token, stamp, stamp]
        else:
            values = [stamp, stamp, stamp]
        text = d.fan_out(
            None if types is None else len(types), after is not None, claiming
        )
        if d.writable_cte:
            with self._cursor() as cursor:
                cursor.execute(text, [*select, *subs, *values])
                found = cursor.fetchall()
            ids = [d.uuid_value(row[0]) for row in found]
            flipped = sum(1 for row in found if row[1])
            if not claiming:
                return FannedOut(ids, flipped, [])
            when = d.datetime_reader()
            contexts = [
                _context(d, when, row[2:]) for row in found if row[2] is not None
            ]
            contexts.sort(key=lambda c: c.delivery_id)
            return FannedOut(ids, flipped, contexts)
        find, lock, insert, flip, read = text
        with transaction.atomic(using=self.using), self._cursor() as cursor:
            cursor.execute(find, select)
            ids = [row[0] for row in cursor.fetchall()]
            if ids and lock is not None:
                # The find's filters (its limit and budget left out), then
                # the last id chosen and how many were.
                cursor.execute(lock, [*select[:-3], ids[-1], len(ids)])
                ids = [row[0] for row in cursor.fetchall()]
            if not ids:
                return FannedOut([], 0, [])
            cursor.execute(insert(len(ids)), [*values, *subs, *ids])
            cursor.execute(flip(len(ids)), ids)
            flipped = cursor.rowcount
            found = []
            if claiming:
                cursor.execute(read(len(ids)), [*ids, lease.name, token])
                found = cursor.fetchall()
        when = d.datetime_reader()
        return FannedOut(
            [d.uuid_value(i) for i in ids],
            flipped,
            [_context(d, when, row) for row in found],
        )

    # --- claims -----------------------------------------------------------------

    @_reissued_on_deadlock
    def claim(
        self,
        names: Sequence[str],
        *,
        limit: int,
        lease_seconds: float,
        worker: str,
        now: datetime.datetime,
        ordered: bool = False,
        event_types: frozenset[str] | None = None,
        max_bytes: int = UNBOUNDED,
    ) -> tuple[uuid.UUID, list[DeliveryContext]]:
        """Lease up to ``limit`` due deliveries stored under ``names`` and
        read what delivering them needs, event payload included: the first
        rows in claim order whose payloads add up to at most ``max_bytes``
        bytes, and always the first row (a payload larger than the budget
        goes alone).

        The rows become RUNNING with ``attempts + 1``, a fresh lease token and
        ``locked_until = next_retry_at = now + lease_seconds``; rows another
        relay holds are skipped (``FOR UPDATE SKIP LOCKED``). Due means PENDING,
        or FAILED whose retry time has come, or RUNNING whose lease ran out.
        ``ordered`` claims each aggregate's head only: a row with no earlier
        unfinished delivery of its (subscriber, aggregate), and no earlier
        event of its aggregate and of ``event_types`` still waiting for
        fan-out; earlier means a lower ``position`` (publish order, numbered
        by the database on insert: a total order).

        Returns:
            ``(lease token, contexts in delivery id order)``.
        """
        d = self.dialect
        token = uuid.uuid4()
        expiry = now + datetime.timedelta(seconds=lease_seconds)
        stamp, until = d.datetime_param(now), d.datetime_param(expiry)
        update = [d.uuid_param(token), worker[:255], until, until, stamp]
        select = [*names, stamp]
        if ordered and event_types is not None:
            select += sorted(event_types)
        select += [limit, max_bytes, 1]
        key = (len(names), ordered, None if event_types is None else len(event_types))
        if d.writable_cte:
            with self._cursor() as cursor:
                cursor.execute(d.claim(*key), [*update, *select])
                rows = cursor.fetchall()
        elif d.update_returning:
            claim, read = d.claim(*key)
            with self._cursor() as cursor:
                cursor.execute(claim, [*update, *select])
                ids = [row[0] for row in cursor.fetchall()]
                if not ids:
                    return token, []
                cursor.execute(read(len(ids)), ids)
                rows = cursor.fetchall()
        else:
            lock, mark, read = d.claim(*key)
            with transaction.atomic(using=self.using), self._cursor() as cursor:
                cursor.execute(lock, select)
                ids = [row[0] for row in cursor.fetchall()]
                if not ids:
                    return token, []
                cursor.execute(mark(len(ids)), [*update, *ids])
                cursor.execute(read(len(ids)), ids)
                rows = cursor.fetchall()
        when = d.datetime_reader()
        return token, [_context(d, when, row) for row in rows]

    # --- outcomes (compare-and-set on the lease token) -------------------------------

    @_reissued_on_deadlock
    def renew(
        self, token: uuid.UUID, ids: Sequence[int], expiry: datetime.datetime, now
    ) -> set[int]:
        """Extend the lease of the rows of ``ids`` still held under ``token`` to
        ``expiry``. Returns the ids still held (the others were taken over by
        another relay after their lease ran out, or finished)."""
        if not ids:
            return set()
        d = self.dialect
        until = d.datetime_param(expiry)
        params = [until, until, d.datetime_param(now)]
        params += [*d.list_params(ids), d.uuid_param(token)]
        with self._cursor() as cursor:
            if d.update_returning:
                cursor.execute(d.renew(len(ids), True), params)
                return {row[0] for row in cursor.fetchall()}
            cursor.execute(d.renew(len(ids), False), params)
            if cursor.rowcount == len(ids):
                return set(ids)
            cursor.execute(d.held(len(ids)), params[3:])
            return {row[0] for row in cursor.fetchall()}

    @_reissued_on_deadlock
    def succeed(
        self, token: uuid.UUID, ids: Sequence[int], now: datetime.datetime
    ) -> int:
        """Mark the rows of ``ids`` held under ``token`` SUCCEEDED. Returns rows
        written; fewer than ``ids`` means leases were lost."""
        if not ids:
            return 0
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [stamp, stamp, *d.list_params(ids), d.uuid_param(token)]
        with self._cursor() as cursor:
            cursor.execute(d.succeed(len(ids)), params)
            return cursor.rowcount

    @_reissued_on_deadlock
    def fail(
        self,
        token: uuid.UUID,
        delivery_id: int,
        *,
        error: str,
        error_type: str,
        traceback: str,
        retry_at: datetime.datetime | None,
        now: datetime.datetime,
    ) -> bool:
        """Record a failed attempt on one row held under ``token``:
        ``retry_at=None`` expires it (the dead letter), otherwise it becomes
        FAILED, due at ``retry_at``. The error is kept either way. Returns
        False when the lease was lost (nothing written)."""
        d = self.dialect
        stamp = d.datetime_param(now)
        dead = retry_at is None
        params = [
            State.DEAD if dead else State.FAILED,
            error,
            error_type[:255],
            traceback,
            stamp,
            None if dead else d.datetime_param(retry_at),
            stamp if dead else None,
            stamp,
            delivery_id,
            d.uuid_param(token),
        ]
        with self._cursor() as cursor:
            cursor.execute(d.fail, params)
            return cursor.rowcount == 1

    @_reissued_on_deadlock
    def release(
        self,
        token: uuid.UUID,
        ids: Sequence[int],
        now: datetime.datetime,
        due: datetime.datetime | None = None,
    ) -> int:
        """Hand back rows of ``ids`` claimed under ``token`` and never attempted
        (a relay stopping, a batch claimed ahead and not needed, a publisher
        paused by an outage): the claim's attempt taken back, due at ``due``
        (default ``now``). Returns rows released."""
        if not ids:
            return 0
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [d.datetime_param(due or now), stamp]
        params += [*d.list_params(ids), d.uuid_param(token)]
        with self._cursor() as cursor:
            cursor.execute(d.release(len(ids)), params)
            return cursor.rowcount

    @_reissued_on_deadlock
    def lapse(
        self,
        token: uuid.UUID,
        ids: Sequence[int],
        *,
        error: str,
        error_type: str,
        now: datetime.datetime,
    ) -> int:
        """SKIPPED, never attempted: rows of ``ids`` claimed under ``token``
        whose event expired before delivery (the claim's attempt taken back,
        ``error`` and ``error_type`` recorded as the reason). Returns rows
        written."""
        if not ids:
            return 0
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [error, error_type[:255], stamp, stamp]
        params += [*d.list_params(ids), d.uuid_param(token)]
        with self._cursor() as cursor:
            cursor.execute(d.lapse(len(ids)), params)
            return cursor.rowcount


# --- stream delivery ----------------------------------------------------------------


@dataclass(frozen=True)
class Reading:
    """Where a cursor reads (:class:`~outbox_app.store.models.Cursor`).

    Attributes:
        tick: the last tick read to its end (PostgreSQL: a snapshot's text);
            None where a position alone is read (SQLite).
        next_tick: the tick being read; None: the next read takes one.
        position: the last event position delivered (PostgreSQL: within
            ``next_tick``); 0: none.
    """

    tick: str | None
    next_tick: str | None
    position: int


@dataclass(frozen=True)
class Streamed:
    """One event of a stream read: its delivery context (``delivery_id``
    None, attempt 1) and whether an unfinished delivery of its aggregate
    waits before it (``held``: ordered subscribers)."""

    context: DeliveryContext
    held: bool = False


@dataclass(frozen=True)
class StreamRead:
    """A batch of stream delivery.

    Attributes:
        tick: the tick read (PostgreSQL: a snapshot's text; None on SQLite).
        events: the events, in position order.
        more: whether events may follow in the same tick (the limit or the
            byte budget cut the batch short).
    """

    tick: str | None
    events: list[Streamed]
    more: bool


@dataclass(frozen=True)
class Diverted:
    """The delivery row stream delivery writes for an event it passes without
    delivering it (the ``divert`` transition): the columns of
    :attr:`Dialect.DIVERTED <outbox_app.store.sql.base.Dialect.DIVERTED>`
    besides the subscriber, which the caller gives."""

    event_id: uuid.UUID
    state: str
    attempts: int
    next_retry_at: datetime.datetime
    locked_until: datetime.datetime | None = None
    locked_by: str = ""
    lease_token: uuid.UUID | None = None
    last_error: str = ""
    last_error_type: str = ""
    last_traceback: str = ""
    first_failed_at: datetime.datetime | None = None
    completed_at: datetime.datetime | None = None


def streaming(using: str = "default") -> bool:
    """Whether events published on database ``using`` are delivered by stream
    (each subscriber's cursor reads them; rows only for what needs
    attention) rather than by a delivery row per subscriber: unless
    ``OUTBOX_ENGINE`` is ``"rows"``. ``publish()`` writes an event for the
    one or the other; relays deliver both kinds of event whatever the
    setting, on every database (``using``)."""
    return outbox_settings.ENGINE != "rows"


def partitions(subscriber, using: str = "default") -> int:
    """How many partitions stream delivery splits ``subscriber``'s events
    into on database ``using``: its ``partitions`` option, else
    ``OUTBOX_PARTITIONS``; one where one relay serves the database
    (SQLite)."""
    if dialect(using).single_writer:
        return 1
    return subscriber.partitions or outbox_settings.PARTITIONS


class Stream:
    """The statements of stream delivery on database ``using``: a cursor's
    lease, its reads and its moves, and the delivery rows of the events it
    passes without delivering them (:class:`Diverted`).

    A cursor is moved with a compare-and-set on its lease token, so a relay
    that lost the lease (it stalled past it and another relay took the
    cursor) moves nothing; a move runs in the caller's transaction when
    there is one (a handler group's, with the handlers' writes).
    """

    def __init__(self, using: str = "default"):
        self.using = using
        #: Where the relays number events (MySQL/MariaDB): the highest number
        #: this relay's numbering has seen given, and whether its last
        #: numbering took as many events as it may (more wait to be
        #: numbered, at the next tick): :meth:`number`.
        self.given = 0
        self.behind = False
        #: Whether this relay numbered events in its loop's current turn
        #: (:meth:`tick`, :meth:`turn`).
        self.numbered = False

    @property
    def dialect(self) -> Dialect:
        return dialect(self.using)

    def _cursor(self):
        return self.dialect.cursor(connections[self.using])

    def take(
        self,
        cursor_id: int,
        *,
        token: uuid.UUID,
        worker: str,
        expiry: datetime.datetime,
        now: datetime.datetime,
    ) -> tuple[Reading, str | None, int] | None:
        """Lease the cursor ``cursor_id`` if it is free or its lease ran out
        (by ``now``), until ``expiry``. Returns its :class:`Reading`, its
        stop tick and the last position delivered of a reading transaction's
        own events (0: none), or None (another relay holds it, or it is
        gone)."""
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [
            d.uuid_param(token),
            worker[:255],
            d.datetime_param(expiry),
            stamp,
            cursor_id,
            stamp,
        ]
        with self._cursor() as cursor:
            cursor.execute(d.take_cursor, params)
            row = self._returned(cursor, d.TAKEN, cursor_id, token)
        if row is None:
            return None
        tick, next_tick, position, stop_tick, own = row
        return Reading(tick, next_tick, position or 0), stop_tick, own or 0

    def read(
        self,
        subscriber: str,
        reading: Reading,
        *,
        event_types: frozenset[str] | None,
        partitions: int,
        partition: int,
        held: Sequence[str] | None,
        limit: int,
        max_bytes: int = UNBOUNDED,
        walk: bool = False,
        own: bool = False,
    ) -> StreamRead:
        """The next batch of the cursor at ``reading``: up to ``limit`` events
        of ``event_types`` (None: every type) in the partition, in position
        order, whose payloads add up to at most ``max_bytes`` bytes (the first
        event alone, however large). Where ``reading`` has no tick being read
        (PostgreSQL), a tick is taken now and returned. ``held``: the names of
        an ordered subscriber, whose events waiting behind an unfinished
        delivery of their aggregate are flagged. ``walk``: read on by the
        position index (a large tick, after its first batch). ``own``: the
        events of the reading transaction itself after ``reading.position``
        instead, with no tick (a relay run inside a caller's transaction,
        as a test's: a tick counts its own transaction as committed)."""
        d = self.dialect
        params: list = [] if held is None else list(held)
        with self._cursor() as cursor:
            tick = None
            if d.stream != "position" and not own:
                prev, tick = reading.tick, reading.next_tick
                if tick is None:
                    tick = self.tick(cursor)
                    if prev is None or tick == prev:
                        # Nothing committed since the last tick (the same
                        # snapshot): no event can be new. (No last tick: the
                        # cursor starts at this one.)
                        return StreamRead(tick, [], False)
                params += d.tick_params(prev, tick, walk)
            if event_types is not None:
                params += sorted(event_types)
            partitioned = partitions > 1
            if partitioned:
                params += [partitions, partition]
            params += [reading.position, limit, max_bytes]
            text = d.stream_read(
                None if event_types is None else len(event_types),
                partitioned,
                None if held is None else len(held),
                walk,
                own,
            )
            cursor.execute(text, params)
            rows = cursor.fetchall()
        events: list[Streamed] = []
        candidates = 0
        width = len(EVENT_COLUMNS)
        when = d.datetime_reader()
        for row in rows:
            flag = bool(row[-2]) if held is not None else False
            context = _context(
                d, when, (None, 1, subscriber, *row[1 : 1 + width]), position=row[0]
            )
            events.append(Streamed(context, flag))
            candidates = row[-1]
        more = candidates >= limit or len(events) < candidates
        return StreamRead(tick, events, more)

    def tick(self, cursor) -> str:
        """A tick taken now through ``cursor`` (a DB-API cursor). Where the
        relays number events (MySQL/MariaDB), the committed events not
        numbered yet are numbered first (:meth:`number`), once a turn of the
        relay's loop (:meth:`turn`): the other cursors read in the turn
        take the last number given (one statement, not a numbering's
        transaction per cursor)."""
        d = self.dialect
        if d.stream == "numbered":
            if self.numbered:
                # Below what this relay saw given: the sequencer's row was
                # deleted meanwhile; numbering creates it again, above.
                current = d.current_tick(cursor)
                if int(current) >= self.given:
                    return current
            last = self.number()
            if last is not None:
                self.numbered = True
                return str(last)
        return d.current_tick(cursor)

    def turn(self) -> None:
        """A new turn of the relay's loop begins: the next tick numbers the
        events committed since (:meth:`tick`)."""
        self.numbered = False

    def first_reading(self, earliest: bool) -> tuple[str | None, int]:
        """Where a new cursor starts: ``(tick, position)`` of the events
        committed from now on, or with ``earliest`` of every event kept.
        Where the relays number events (MySQL/MariaDB), those committed and
        not numbered yet are numbered first, so the cursor starts after
        them; except inside a transaction (one publishing, as it records the
        subscribers it knows of), which would hold the sequencer's row to
        its end: there the cursor also receives the events committed since
        a relay last numbered."""
        d = self.dialect
        if (
            not earliest
            and d.stream == "numbered"
            and not connections[self.using].in_atomic_block
        ):
            while self.number() is not None and self.behind:
                pass  # a backlog: numbered to its end
        return d.first_reading(self.using, earliest)

    def number(self, limit: int = NUMBER_LIMIT) -> int | None:
        """Number up to ``limit`` committed events written for stream
        delivery that have none yet, in position order, after the last
        number given, in one transaction holding the sequencer's row
        (MySQL/MariaDB: :class:`~outbox_app.store.models.Sequencer`). Returns
        the last number given, or None when another relay holds the row (it
        is numbering now). Sets :attr:`given` and :attr:`behind`."""
        d = self.dialect
        self.behind = False
        with transaction.atomic(using=self.using), self._cursor() as cursor:
            cursor.execute(d.sequencer_lock)
            row = cursor.fetchone()
            if row is None:
                cursor.execute(d.sequencer_last)
                if cursor.fetchone() is not None:
                    return None  # held
                cursor.execute(d.sequencer_create)
                cursor.execute(d.sequencer_lock)
                row = cursor.fetchone()
                if row is None:
                    return None  # another relay created it, and holds it
            last = row[0]
            cursor.execute(d.unnumbered, [limit])
            positions = [found[0] for found in cursor.fetchall()]
            self.behind = len(positions) == limit
            if positions:
                # Numbered after the last given, as their positions go.
                offset = last + 1 - positions[0]
                cursor.execute(d.number(len(positions)), [offset, *positions])
                last = positions[-1] + offset
                cursor.execute(d.sequenced, [last])
            self.given = max(self.given, last)
            return last

    def numbered_after(self, tick: str | None) -> bool:
        """Whether a next tick would read events after ``tick`` (one read to
        its end) at once, where the relays number events (MySQL/MariaDB):
        this relay's numbering gave numbers beyond it (another cursor's
        tick took them), or left events waiting to be numbered. False
        elsewhere."""
        if self.dialect.stream != "numbered" or tick is None:
            return False
        return self.behind or int(tick) < self.given

    def move(
        self,
        cursor_id: int,
        token: uuid.UUID,
        reading: Reading,
        *,
        expiry: datetime.datetime,
        now: datetime.datetime,
        ticked: bool = False,
    ) -> str | None:
        """Write ``reading`` as the cursor's and extend its lease to
        ``expiry``, if it is still held under ``token`` (``ticked``: a tick
        was read to its end). Returns the name of a relay that asked for the
        cursor (``""``: none), or None when the lease was lost (nothing
        written)."""
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [
            reading.tick,
            reading.next_tick,
            reading.position or None,
            d.datetime_param(expiry),
            stamp if ticked else None,
            stamp,
            cursor_id,
            d.uuid_param(token),
        ]
        with self._cursor() as cursor:
            cursor.execute(d.advance_cursor, params)
            row = self._returned(cursor, "wanted_by", cursor_id, token)
        return None if row is None else row[0]

    def _returned(
        self, cursor, columns: str, cursor_id: int, token: uuid.UUID
    ) -> tuple | None:
        """The row an ``UPDATE`` of the cursor ``cursor_id`` fenced by
        ``token`` returned (``columns``); where the database returns none,
        read after it (None: it updated no row)."""
        d = self.dialect
        if d.update_returning:
            return cursor.fetchone()
        if cursor.rowcount != 1:
            return None
        cursor.execute(d.held_cursor(columns), [cursor_id, d.uuid_param(token)])
        return cursor.fetchone()

    def own(self, cursor_id: int, token: uuid.UUID, position: int) -> bool:
        """Write ``position`` as the last delivered of the reading
        transaction's own events, if the cursor is still held under
        ``token`` (in that transaction: it commits with its events, or
        neither does). Returns False when the lease was lost."""
        d = self.dialect
        with self._cursor() as cursor:
            cursor.execute(d.own_cursor, [position, cursor_id, d.uuid_param(token)])
            return cursor.rowcount == 1

    def release(
        self,
        cursor_id: int,
        token: uuid.UUID,
        reading: Reading,
        *,
        now: datetime.datetime,
        ticked: bool = False,
    ) -> bool:
        """Write ``reading`` and hand the cursor back (free for any relay), if
        it is still held under ``token``. Returns False when it was not."""
        d = self.dialect
        stamp = d.datetime_param(now)
        params = [
            reading.tick,
            reading.next_tick,
            reading.position or None,
            stamp if ticked else None,
            stamp,
            cursor_id,
            d.uuid_param(token),
        ]
        with self._cursor() as cursor:
            cursor.execute(d.release_cursor, params)
            return cursor.rowcount == 1

    def divert(
        self,
        subscriber: str,
        rows: Sequence[Diverted],
        now: datetime.datetime,
        *,
        returning: bool = False,
    ) -> list[int | None]:
        """Insert the delivery rows of ``rows`` for ``subscriber`` (one per
        event; an existing ``(event, subscriber)`` row is left alone).
        Returns, with ``returning``, each new row's id (None where a row
        existed); otherwise an empty list."""
        if not rows:
            return []
        d = self.dialect
        stamp = d.datetime_param(now)

        def params(row: Diverted) -> list:
            return [
                subscriber,
                row.state,
                row.attempts,
                d.datetime_param(row.next_retry_at),
                None
                if row.locked_until is None
                else d.datetime_param(row.locked_until),
                row.locked_by[:255],
                d.uuid_param(row.lease_token),
                row.last_error,
                row.last_error_type[:255],
                row.last_traceback,
                None
                if row.first_failed_at is None
                else d.datetime_param(row.first_failed_at),
                None
                if row.completed_at is None
                else d.datetime_param(row.completed_at),
                stamp,
                stamp,
                d.uuid_param(row.event_id),
            ]

        with self._cursor() as cursor:
            if not returning:
                cursor.executemany(d.divert(False), [params(r) for r in rows])
                return []
            ids: list[int | None] = []
            for row in rows:
                cursor.execute(d.divert(True), params(row))
                if not d.update_returning:
                    ids.append(cursor.lastrowid if cursor.rowcount == 1 else None)
                    continue
                found = cursor.fetchone()
                ids.append(None if found is None else found[0])
            return ids


def _context(
    d: Dialect,
    when: Callable[[Any], datetime.datetime | None],
    row: tuple,
    position: int | None = None,
) -> DeliveryContext:
    """A row read as a delivery's context; ``when``: the read's
    :meth:`~outbox_app.store.sql.base.Dialect.datetime_reader`."""
    (
        delivery_id,
        attempts,
        subscriber,
        event_id,
        namespace,
        event_type,
        revision,
        payload,
        aggregate_type,
        aggregate_id,
        aggregate_version,
        headers,
        tenant_id,
        action_id,
        occurred_at,
        deliver_at,
        expires_at,
        operation,
        payload_bytes,
    ) = row
    return DeliveryContext(
        event_id=d.uuid_value(event_id),
        namespace=namespace,
        event_type=event_type,
        revision=revision,
        payload=d.json_value(payload),
        aggregate_type=aggregate_type,
        aggregate_id=aggregate_id,
        aggregate_version=aggregate_version,
        headers=d.json_value(headers),
        tenant_id=tenant_id,
        action_id=d.uuid_value(action_id),
        occurred_at=when(occurred_at),
        attempt=attempts,
        subscriber=subscriber,
        delivery_id=delivery_id,
        deliver_at=when(deliver_at),
        expires_at=when(expires_at),
        operation=operation,
        payload_bytes=payload_bytes,
        using=d.alias,
        position=position,
    )
