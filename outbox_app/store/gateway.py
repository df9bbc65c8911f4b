"""The relay's SQL: every statement of the delivery hot path, in one place.

Fan-out, claim, renew, succeed, fail and release are named statements, built
once per process and database (their text depends only on the dialect and on
how many values a list holds) and sent through the DB-API cursor with
parameters; rows come back as tuples and become
:class:`~outbox_app.subscribers.DeliveryContext` values, never model
instances. This module is the only place the relay's SQL is sent from
(procrastinate's ``manager.py`` and ``sql/queries.sql`` are the model); the
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

Dialect differences come from :class:`outbox_app.store.db.Dialect`; the state
names from :mod:`outbox_app.store.lifecycle`.
"""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import connections, transaction

from ..subscribers import WILDCARD, DeliveryContext
from .db import Dialect, dialect, reissued_on_deadlock
from .lifecycle import CLAIMABLE, UNFINISHED, State
from .models import Delivery, OutboxEvent, Subscription

N = Delivery._meta.db_table
E = OutboxEvent._meta.db_table
S = Subscription._meta.db_table

#: The event columns a delivery reads (DeliveryContext), in its order.
EVENT_COLUMNS = (
    "id",
    "namespace",
    "event_type",
    "revision",
    "payload",
    "aggregate_type",
    "aggregate_id",
    "aggregate_version",
    "headers",
    "tenant_id",
    "action_id",
    "occurred_at",
    "deliver_at",
    "expires_at",
    "operation",
    "payload_bytes",
)

#: No byte budget: larger than any batch's payloads.
UNBOUNDED = 2**62


def _states(states: Sequence[str]) -> str:
    """An SQL list of state names, in the order the partial indexes spell them
    (SQLite uses a partial index only for a condition written the same way)."""
    return ", ".join(f"'{state}'" for state in states)


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

    def _cursor(self):
        return connections[self.using].cursor()

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
        text = _statements(self.using, d.vendor).fan_out(
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
            contexts = [_context(d, row[2:]) for row in found if row[2] is not None]
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
        return FannedOut(
            [d.uuid_value(i) for i in ids], flipped, [_context(d, row) for row in found]
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
        sql = _statements(self.using, d.vendor)
        key = (len(names), ordered, None if event_types is None else len(event_types))
        if d.writable_cte:
            with self._cursor() as cursor:
                cursor.execute(sql.claim(*key), [*update, *select])
                rows = cursor.fetchall()
        elif d.update_returning:
            claim, read = sql.claim(*key)
            with self._cursor() as cursor:
                cursor.execute(claim, [*update, *select])
                ids = [row[0] for row in cursor.fetchall()]
                if not ids:
                    return token, []
                cursor.execute(read(len(ids)), ids)
                rows = cursor.fetchall()
        else:
            lock, mark, read = sql.claim(*key)
            with transaction.atomic(using=self.using), self._cursor() as cursor:
                cursor.execute(lock, select)
                ids = [row[0] for row in cursor.fetchall()]
                if not ids:
                    return token, []
                cursor.execute(mark(len(ids)), [*update, *ids])
                cursor.execute(read(len(ids)), ids)
                rows = cursor.fetchall()
        return token, [_context(d, row) for row in rows]

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
        sql = _statements(self.using, d.vendor)
        with self._cursor() as cursor:
            if d.update_returning:
                cursor.execute(sql.renew(len(ids), True), params)
                return {row[0] for row in cursor.fetchall()}
            cursor.execute(sql.renew(len(ids), False), params)
            if cursor.rowcount == len(ids):
                return set(ids)
            cursor.execute(sql.held(len(ids)), params[3:])
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
            cursor.execute(_statements(self.using, d.vendor).succeed(len(ids)), params)
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
            cursor.execute(_statements(self.using, d.vendor).fail, params)
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
            cursor.execute(_statements(self.using, d.vendor).release(len(ids)), params)
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
            cursor.execute(_statements(self.using, d.vendor).lapse(len(ids)), params)
            return cursor.rowcount


def _context(d: Dialect, row: tuple) -> DeliveryContext:
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
        occurred_at=d.datetime_value(occurred_at),
        attempt=attempts,
        subscriber=subscriber,
        delivery_id=delivery_id,
        deliver_at=d.datetime_value(deliver_at),
        expires_at=d.datetime_value(expires_at),
        operation=operation,
        payload_bytes=payload_bytes,
    )


# --- the statements -----------------------------------------------------------


@functools.cache
def _statements(using: str, vendor: str) -> _Statements:
    return _Statements(dialect(using))


class _Statements:
    """The SQL text of every statement, per dialect; variants by list length
    are built on first use and kept (``functools.cache`` per instance)."""

    def __init__(self, d: Dialect):
        self.d = d
        q = d.quote
        self.n, self.e, self.s = q(N), q(E), q(S)
        self.claimable = _states(CLAIMABLE)
        self.unfinished = _states(UNFINISHED)
        # The partial index spells it NOT "fanned_out" (SQLite matches the text).
        self.awaiting_fanout = "NOT e.fanned_out"
        self.fail = (
            f"UPDATE {self.n} SET state = %s, last_error = %s, last_error_type = %s, "
            "last_traceback = %s, first_failed_at = COALESCE(first_failed_at, %s), "
            "next_retry_at = COALESCE(%s, next_retry_at), completed_at = %s, "
            "locked_until = NULL, lease_token = NULL, updated_at = %s "
            f"WHERE id = %s AND lease_token = %s AND state = '{State.RUNNING}'"
        )

    def _held(self, count: int) -> str:
        """Rows of an id list still held under a lease token (the fence every
        outcome passes)."""
        return (
            f"{self.d.in_list('id', count)} AND lease_token = %s "
            f"AND state = '{State.RUNNING}'"
        )

    def _read(self, where: str) -> str:
        """Claimed deliveries (``c``) with the event columns a delivery
        reads, in delivery id order."""
        columns = ", ".join(f"e.{c}" for c in EVENT_COLUMNS)
        return (
            f"SELECT c.id, c.attempts, c.subscriber, {columns} FROM {self.n} c "
            f"JOIN {self.e} e ON e.id = c.event_id WHERE {where} ORDER BY c.id"
        )

    # -- fan-out

    @functools.cache  # noqa: B019 (one instance per database, kept for the process)
    def fan_out(self, type_count: int | None, paged: bool, claiming: bool):
        """PostgreSQL: one statement returning one row per event taken (its
        id, whether it was flipped, then the claimed delivery's columns or
        NULLs). Elsewhere:
        ``(find, lock or None, insert(count), flip(count), read(count))``."""
        d, n, e = self.d, self.n, self.e
        where = [self.awaiting_fanout, "e.event_type IS NOT NULL"]
        if type_count is not None:
            where.append(f"e.event_type IN ({', '.join(['%s'] * type_count)})")
        if paged:
            where.append("e.id > %s")
        lock = " FOR UPDATE SKIP LOCKED" if d.skip_locked else ""
        copied_columns = [
            "id",
            "event_type",
            "aggregate_type",
            "aggregate_id",
            "aggregate_version",
            "tenant_id",
            "deliver_at",
            "position",
            "payload_bytes",
        ]
        batch_columns = (
            [*EVENT_COLUMNS, "position"]
            if claiming and d.writable_cte
            else copied_columns
        )
        # MySQL/MariaDB read a row whole, off-page payload included, to lock
        # it (InnoDB's exclusive locking reads): a claiming batch is chosen
        # without locks, within its budget, and only those events are locked.
        lock_later = claiming and not d.writable_cte and bool(lock)
        select = (
            f"SELECT {', '.join(f'e.{c}' for c in batch_columns)} FROM {e} e "
            f"WHERE {' AND '.join(where)} ORDER BY e.id LIMIT %s"
            + ("" if lock_later else lock)
        )
        if claiming:
            # What the claim may hold: the first events within its budget.
            select = self._within_budget(select, batch_columns, "id")
        # (name, event type or * for every type[, claimed 1/0]) per active
        # subscription, read where the deliveries are written.
        claimed = (
            ", CASE WHEN subscriber = %s THEN 1 ELSE 0 END AS claimed"
            if claiming
            else ""
        )
        pairs = (
            f"SELECT subscriber AS name, event_type{claimed} FROM {self.s} "
            "WHERE retired_at IS NULL"
        )
        columns = (
            "event_id, subscriber, event_type, aggregate_type, aggregate_id, "
            "aggregate_version, tenant_id, deliver_at, position, payload_bytes, "
            "state, attempts, next_retry_at, locked_until, locked_by, lease_token, "
            "last_error, last_error_type, last_traceback, created_at, updated_at"
        )
        copied = (
            "b.id, s.name, b.event_type, b.aggregate_type, b.aggregate_id, "
            "b.aggregate_version, b.tenant_id, b.deliver_at, b.position, "
            "b.payload_bytes"
        )
        # A scheduled event's rows are due at its deliver_at (publish() stores
        # only times still ahead), so the claim's index orders them by it; they
        # are never claimed here, as they are created.
        due = "COALESCE(b.deliver_at, %s)"
        if claiming:
            mine = "CASE WHEN s.claimed = 1 AND b.deliver_at IS NULL THEN"
            values = (
                f"{copied}, {mine} '{State.RUNNING}' ELSE '{State.PENDING}' END, "
                f"{mine} 1 ELSE 0 END, {mine} %s ELSE {due} END, {mine} %s END, "
                f"{mine} %s ELSE '' END, {mine} %s END, '', '', '', %s, %s"
            )
        else:
            values = (
                f"{copied}, '{State.PENDING}', 0, {due}, NULL, '', NULL, '', '', '', "
                "%s, %s"
            )
        join = f"s.event_type = '{WILDCARD}' OR s.event_type = b.event_type"
        if d.writable_cte:
            # The events flipped are those the insert found a subscription
            # for: s is read once, by the same snapshot as the insert.
            created = (
                f"created AS (INSERT INTO {n} ({columns}) SELECT {values} "
                f"FROM b JOIN s ON {join} ORDER BY b.id ON CONFLICT DO NOTHING"
                + (
                    " RETURNING id, attempts, subscriber, event_id, state)"
                    if claiming
                    else ")"
                )
            )
            statement = (
                f"WITH b AS ({select}), s AS ({pairs}), "
                f"flipped AS (UPDATE {e} SET fanned_out = TRUE "
                f"WHERE id = ANY(ARRAY(SELECT b.id FROM b JOIN s ON {join})) "
                f"RETURNING id), {created} "
            )
            matched = "b.id IN (SELECT id FROM flipped)"
            if not claiming:
                return statement + f"SELECT b.id, {matched} FROM b ORDER BY b.id"
            event_columns = ", ".join(f"b.{c}" for c in EVENT_COLUMNS)
            return (
                statement + f"SELECT b.id, {matched}, c.id, c.attempts, c.subscriber, "
                f"{event_columns} FROM b LEFT JOIN created c ON c.event_id = b.id "
                f"AND c.state = '{State.RUNNING}' ORDER BY b.id"
            )
        ignore_prefix, ignore_suffix = (
            ("INSERT IGNORE INTO", "")
            if d.vendor == "mysql"
            else ("INSERT INTO", " ON CONFLICT DO NOTHING")
        )

        @functools.cache
        def insert(count: int) -> str:
            return (
                f"{ignore_prefix} {n} ({columns}) SELECT {values} FROM {e} b "
                f"JOIN ({pairs}) s ON {join} WHERE {d.in_list('b.id', count)} "
                f"ORDER BY b.id{ignore_suffix}"
            )

        @functools.cache
        def flip(count: int) -> str:
            # Only the events that have a delivery now: one whose every
            # subscription was retired before the insert read them keeps
            # waiting for fan-out.
            return (
                f"UPDATE {e} SET fanned_out = 1 WHERE {d.in_list('id', count)} "
                f"AND EXISTS (SELECT 1 FROM {n} x WHERE x.event_id = {e}.id)"
            )

        @functools.cache
        def read(count: int) -> str:
            return self._read(
                f"{d.in_list('c.event_id', count)} AND c.subscriber = %s "
                "AND c.lease_token = %s"
            )

        # The chosen events (up to the last one chosen, as many), locked,
        # skipping those another relay holds: the find's scan, bounded.
        locked = (
            f"SELECT e.id FROM {e} e WHERE {' AND '.join(where)} AND e.id <= %s "
            f"ORDER BY e.id LIMIT %s{lock}"
        )
        # Parameters: the find's; the lock's: the find's filters, the last id
        # chosen and how many; the insert's values,
        # subscriptions, ids; the flip's ids; the read's ids, name and token
        # (see Gateway.fan_out).
        return (
            select,
            locked if lock_later else None,
            functools.cache(insert),
            functools.cache(flip),
            functools.cache(read),
        )

    # -- claims

    def _within_budget(self, rows: str, columns: Sequence[str], order: str) -> str:
        """The first rows of ``rows`` (a SELECT of ``columns``, ``payload_bytes``
        and the columns of ``order``, locked where the database locks) in
        ``order`` whose payloads add up to at most a budget in bytes (the
        first parameter after ``rows``'s), and at least as many rows as the
        second one says (1: a payload over the budget goes alone; 0: none).
        The running sum is taken outside the locking SELECT (PostgreSQL
        refuses window functions beside ``FOR UPDATE``); the few rows locked
        past the budget are left as they were."""
        names = ", ".join(columns)
        return (
            f"SELECT {names} FROM (SELECT {names}, SUM(payload_bytes) OVER "
            f"(ORDER BY {order} ROWS UNBOUNDED PRECEDING) AS running, "
            f"ROW_NUMBER() OVER (ORDER BY {order}) AS n FROM ({rows}) k) w "
            "WHERE w.running <= %s OR w.n <= %s"
        )

    def _candidates(self, names: int, ordered: bool, types: int | None) -> str:
        """Due rows of a subscriber's names, in claim order, locked skipping the
        rows another relay holds: ``id, next_retry_at, payload_bytes``."""
        d, n, e = self.d, self.n, self.e
        where = [
            f"c.subscriber IN ({', '.join(['%s'] * names)})",
            f"c.state IN ({self.claimable})",
            "c.next_retry_at <= %s",
        ]
        if ordered:
            # Publish order: positions are numbered by the database on insert,
            # so any two events of an aggregate compare (event ids come from
            # several hosts' clocks; versions may be missing).
            earlier = "{x}.position < c.position"
            # Each candidate, in claim order, is probed by index until the
            # batch is full (the fence). As anti-joins, PostgreSQL's plans
            # swung with the statistics: on never-analyzed tables a nested
            # loop rescanning every unfinished row per candidate (56 s per
            # claim at 7,780 rows), on analyzed ones 16x slower than the
            # probes at 100,000 rows (bench/RESULTS.md, "Ordered claims").
            fence = d.probe_fence
            where.append(
                f"NOT EXISTS (SELECT 1 FROM {n} u WHERE u.subscriber = c.subscriber "
                "AND u.aggregate_type = c.aggregate_type "
                "AND u.aggregate_id = c.aggregate_id "
                f"AND u.state IN ({self.unfinished}) "
                f"AND {earlier.format(x='u')}{fence})"
            )
            waiting = [
                self.awaiting_fanout,
                "e.event_type IS NOT NULL",
                "e.aggregate_type = c.aggregate_type",
                "e.aggregate_id = c.aggregate_id",
            ]
            if types is not None:
                waiting.append(f"e.event_type IN ({', '.join(['%s'] * types)})")
            where.append(
                f"NOT EXISTS (SELECT 1 FROM {e} e WHERE {' AND '.join(waiting)} "
                f"AND {earlier.format(x='e')}{fence})"
            )
        lock = ""
        if d.skip_locked:
            lock = (
                " FOR UPDATE OF c SKIP LOCKED"
                if d.lock_of
                else " FOR UPDATE SKIP LOCKED"
            )
        return (
            f"SELECT c.id, c.next_retry_at, c.payload_bytes FROM {n} c "
            f"WHERE {' AND '.join(where)} "
            f"ORDER BY c.next_retry_at, c.id LIMIT %s{lock}"
        )

    def claim_ids(self, names: int, ordered: bool, types: int | None) -> str:
        """The ids a claim takes: its candidates within the byte budget.
        Parameters: the candidates', then the budget in bytes and 1."""
        return self._within_budget(
            self._candidates(names, ordered, types), ["id"], "next_retry_at, id"
        )

    @functools.cache  # noqa: B019
    def claim(self, names: int, ordered: bool, types: int | None):
        """PostgreSQL: one statement. SQLite: ``(claim, read(count))``.
        MariaDB: ``(lock, mark(count), read(count))``. Parameters: the lease's,
        then the candidates', then the byte budget and 1 (at least one row)."""
        d, n, e = self.d, self.n, self.e
        assign = (
            f"state = '{State.RUNNING}', attempts = attempts + 1, lease_token = %s, "
            "locked_by = %s, locked_until = %s, next_retry_at = %s, updated_at = %s"
        )
        candidates = self.claim_ids(names, ordered, types if ordered else None)
        event_columns = ", ".join(f"e.{c}" for c in EVENT_COLUMNS)
        if d.writable_cte:
            # = ANY(ARRAY(...)): the candidates become one array, computed once,
            # and the update finds its rows by primary key; as "IN (SELECT ...)"
            # PostgreSQL may hash-join a sequential scan of the whole table.
            return (
                f"WITH c AS (UPDATE {n} SET {assign} "
                f"WHERE id = ANY(ARRAY({candidates})) "
                "RETURNING id, attempts, subscriber, event_id) "
                f"SELECT c.id, c.attempts, c.subscriber, {event_columns} "
                f"FROM c JOIN {e} e ON e.id = c.event_id ORDER BY c.id"
            )

        @functools.cache
        def mark(count: int) -> str:
            return f"UPDATE {n} SET {assign} WHERE {d.in_list('id', count)}"

        @functools.cache
        def read(count: int) -> str:
            return self._read(d.in_list("c.id", count))

        if d.update_returning:
            # SQLite: RETURNING may not join, and scalar subqueries there
            # (one per event column) scan the events table for every row; the
            # claimed ids are read back by primary key instead.
            claim = f"UPDATE {n} SET {assign} WHERE id IN ({candidates}) RETURNING id"
            return claim, read
        return candidates, mark, read

    # -- outcomes

    @functools.cache  # noqa: B019
    def renew(self, count: int, returning: bool) -> str:
        return (
            f"UPDATE {self.n} SET locked_until = %s, next_retry_at = %s, "
            f"updated_at = %s WHERE {self._held(count)}"
            + (" RETURNING id" if returning else "")
        )

    @functools.cache  # noqa: B019
    def held(self, count: int) -> str:
        return f"SELECT id FROM {self.n} WHERE {self._held(count)}"

    @functools.cache  # noqa: B019
    def succeed(self, count: int) -> str:
        return (
            f"UPDATE {self.n} SET state = '{State.SUCCEEDED}', completed_at = %s, "
            "locked_until = NULL, lease_token = NULL, updated_at = %s "
            f"WHERE {self._held(count)}"
        )

    @functools.cache  # noqa: B019
    def lapse(self, count: int) -> str:
        return (
            f"UPDATE {self.n} SET state = '{State.SKIPPED}', "
            "attempts = attempts - 1, last_error = %s, last_error_type = %s, "
            "last_traceback = '', completed_at = %s, locked_until = NULL, "
            f"lease_token = NULL, updated_at = %s WHERE {self._held(count)}"
        )

    @functools.cache  # noqa: B019
    def release(self, count: int) -> str:
        # A row with a failed attempt before this claim goes back to FAILED
        # (the SET expressions read the values before the update).
        return (
            f"UPDATE {self.n} SET state = CASE WHEN attempts > 1 "
            f"THEN '{State.FAILED}' ELSE '{State.PENDING}' END, "
            "attempts = attempts - 1, next_retry_at = %s, locked_until = NULL, "
            "lease_token = NULL, locked_by = '', updated_at = %s "
            f"WHERE {self._held(count)}"
        )
