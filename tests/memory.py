"""An in-memory store for fast tests of the relay's turns: row delivery's
statements (:class:`outbox_app.store.gateway.Gateway`) kept in Python
structures, with the same signatures, the same return shapes and the same
rules as the SQL of ``outbox_app/store/sql/base.py``: due times, leases
fenced by their token, an ordered subscriber's later rows of an aggregate
held behind an earlier unfinished one, byte budgets.

Every state change is held against the lifecycle table
(:data:`outbox_app.store.lifecycle.DELIVERY`): a change no transition
allows raises AssertionError naming the transition and the states.

The store keeps its own clock (:meth:`MemoryGateway.now`, moved by the test),
which the relay stamps outcomes with; hand the relay the test's clock too
(``deliver(now=store.now())``)::

    store = MemoryGateway()
    store.subscribe("audit")
    store.publish("order.placed", {"id": 1})
    deliver([publisher], gateway=store, now=store.now(), view=MemoryView())
"""

from __future__ import annotations

import datetime
import itertools
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from outbox_app.store.gateway import UNBOUNDED, FannedOut, Lease
from outbox_app.store.lifecycle import CLAIMABLE, DELIVERY, UNFINISHED, State
from outbox_app.subscribers import WILDCARD, DeliveryContext

#: When a store's clock starts.
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@dataclass
class Event:
    """An outbox event as the relay reads it. ``fanned_out``: False while it
    awaits row delivery's fan-out."""

    id: uuid.UUID
    event_type: str
    payload: dict
    position: int
    occurred_at: datetime.datetime
    aggregate_type: str | None = None
    aggregate_id: str | None = None
    aggregate_version: int | None = None
    headers: dict = field(default_factory=dict)
    tenant_id: str | None = None
    action_id: uuid.UUID | None = None
    deliver_at: datetime.datetime | None = None
    expires_at: datetime.datetime | None = None
    operation: str | None = None
    namespace: str = "tests"
    revision: int = 1
    payload_bytes: int = 0
    fanned_out: bool = False


@dataclass
class Row:
    """A delivery row: the columns the relay's statements read and write."""

    id: int
    event: Event
    subscriber: str
    state: str
    next_retry_at: datetime.datetime
    created_at: datetime.datetime
    attempts: int = 0
    locked_until: datetime.datetime | None = None
    locked_by: str = ""
    lease_token: uuid.UUID | None = None
    last_error: str = ""
    last_error_type: str = ""
    last_traceback: str = ""
    first_failed_at: datetime.datetime | None = None
    completed_at: datetime.datetime | None = None
    updated_at: datetime.datetime | None = None

    @property
    def aggregate(self) -> tuple[str, str] | None:
        """The row's aggregate, or None where SQL's ``=`` matches nothing
        (a NULL aggregate type or id)."""
        e = self.event
        if e.aggregate_type is None or e.aggregate_id is None:
            return None
        return (e.aggregate_type, e.aggregate_id)


def moved(row: Row, name: str, target: str) -> None:
    """Move ``row`` to ``target`` by the transition ``name``.

    Raises:
        AssertionError: the lifecycle has no transition ``name``, or it does
            not take ``row``'s state to ``target``.
    """
    allowed = {t.name: t for t in DELIVERY}
    assert name in allowed, f"{name} is not a transition of the lifecycle"
    transition = allowed[name]
    assert row.state in transition.sources and target in transition.targets, (
        f"{name}: {row.state} -> {target} of delivery {row.id} is not a "
        f"transition of the lifecycle ({transition.sources} -> "
        f"{transition.targets})"
    )
    row.state = target


def created(row: Row, name: str) -> Row:
    """``row``, a new row in its state, made by the transition ``name``.

    Raises:
        AssertionError: ``name`` does not make rows in that state.
    """
    allowed = {t.name: t for t in DELIVERY}
    transition = allowed.get(name)
    assert transition is not None and not transition.sources, (
        f"{name} is not a transition that makes rows"
    )
    assert row.state in transition.targets, (
        f"{name}: a new row in {row.state} is not a transition of the lifecycle "
        f"(it makes {transition.targets})"
    )
    return row


class MemoryGateway:
    """Row delivery's statements (:class:`~outbox_app.store.gateway.Gateway`)
    on Python structures, safe across threads (one lock: a claim ahead runs
    in a second thread).

    Attributes:
        using: the database alias the relay names (its clock, its pauses).
        events: event id -> :class:`Event`, in publish order.
        rows: delivery id -> :class:`Row`.
        subscriptions: ``(subscriber, event type or "*")`` pairs, active.
        statements: the names of the statements run, in order (a claim
            reads as ``"claim"``, a fan-out claiming as ``"fan_out+claim"``).
    """

    def __init__(self, now: datetime.datetime = EPOCH, using: str = "default"):
        self.using = using
        self.clock = now
        self.events: dict[uuid.UUID, Event] = {}
        self.rows: dict[int, Row] = {}
        self.subscriptions: set[tuple[str, str]] = set()
        self.statements: list[str] = []
        self._ids = itertools.count(1)
        self._positions = itertools.count(1)
        self._lock = threading.RLock()

    # --- the test's side -------------------------------------------------------

    def now(self) -> datetime.datetime:
        """The store's clock (the database's, to the relay)."""
        return self.clock

    def advance(self, seconds: float) -> datetime.datetime:
        """Move the clock on by ``seconds``. Returns the new time."""
        self.clock += datetime.timedelta(seconds=seconds)
        return self.clock

    def subscribe(self, subscriber: str, event_type: str = WILDCARD) -> None:
        """Record an active subscription of ``subscriber`` to ``event_type``."""
        self.subscriptions.add((subscriber, event_type))

    def publish(
        self,
        event_type: str,
        payload: dict | None = None,
        *,
        aggregate: tuple[str, str] | None = None,
        payload_bytes: int = 10,
        **columns,
    ) -> Event:
        """An event awaiting fan-out, numbered after every one before it
        (``columns``: more of :class:`Event`'s fields)."""
        aggregate_type, aggregate_id = aggregate or (None, None)
        position = next(self._positions)
        event = Event(
            # Event ids sort in publish order, as UUIDv7 do.
            id=uuid.UUID(int=(position << 64) | (uuid.uuid4().int >> 64)),
            event_type=event_type,
            payload=payload or {},
            position=position,
            occurred_at=self.clock,
            aggregate_type=aggregate_type,
            aggregate_id=aggregate_id,
            payload_bytes=payload_bytes,
            **columns,
        )
        self.events[event.id] = event
        return event

    def of(self, subscriber: str | None = None) -> list[Row]:
        """The rows (of ``subscriber``), in delivery id order."""
        return [
            r
            for r in self.rows.values()
            if subscriber is None or r.subscriber == subscriber
        ]

    def states(self, subscriber: str | None = None) -> dict[str, int]:
        """How many rows (of ``subscriber``) are in each state, as an operator
        counts them."""
        counts: dict[str, int] = {}
        for row in self.of(subscriber):
            counts[row.state] = counts.get(row.state, 0) + 1
        return counts

    def requeue(self, ids: Iterable[int]) -> int:
        """The operator's requeue: FAILED and DEAD rows of ``ids`` due now,
        attempts reset. Returns rows requeued."""
        done = 0
        with self._lock:
            for row in (self.rows[i] for i in ids):
                if row.state in (State.FAILED, State.DEAD):
                    moved(row, "requeue", State.PENDING)
                    row.attempts, row.next_retry_at = 0, self.clock
                    row.completed_at, done = None, done + 1
        return done

    # --- fan-out ---------------------------------------------------------------

    def fan_out(
        self,
        types: frozenset[str] | None,
        limit: int,
        after: uuid.UUID | None,
        now: datetime.datetime,
        lease: Lease | None = None,
    ) -> FannedOut:
        """As :meth:`Gateway.fan_out <outbox_app.store.gateway.Gateway.fan_out>`."""
        with self._lock:
            self.statements.append("fan_out" if lease is None else "fan_out+claim")
            batch = sorted(
                (
                    e
                    for e in self.events.values()
                    if e.fanned_out is False
                    and (types is None or e.event_type in types)
                    and (after is None or e.id > after)
                ),
                key=lambda e: e.id,
            )[:limit]
            if lease is not None:
                batch = _within_budget(
                    batch,
                    lease.max_bytes,
                    int(lease.at_least_one),
                    lambda e: e.payload_bytes,
                )
            taken = {(r.event.id, r.subscriber) for r in self.rows.values()}
            claimed: list[Row] = []
            for event in batch:
                for name in sorted(self._subscribers_of(event.event_type)):
                    if (event.id, name) in taken:
                        continue
                    row = self._insert(event, name, now, lease)
                    taken.add((event.id, name))
                    if row.state == State.RUNNING:
                        claimed.append(row)
            flipped = 0
            for event in batch:
                if any(r.event is event for r in self.rows.values()):
                    event.fanned_out = True
                    flipped += 1
            return FannedOut(
                [e.id for e in batch],
                flipped,
                [_context(r, self.using) for r in claimed],
            )

    def _subscribers_of(self, event_type: str) -> set[str]:
        return {
            name
            for name, subscribed in self.subscriptions
            if subscribed in (WILDCARD, event_type)
        }

    def _insert(
        self, event: Event, name: str, now: datetime.datetime, lease: Lease | None
    ) -> Row:
        mine = lease is not None and name == lease.name and event.deliver_at is None
        row = Row(
            id=next(self._ids),
            event=event,
            subscriber=name,
            state=State.RUNNING if mine else State.PENDING,
            next_retry_at=lease.expiry if mine else (event.deliver_at or now),
            created_at=now,
            updated_at=now,
        )
        if mine:
            row.attempts = 1
            row.locked_until = lease.expiry
            row.locked_by = lease.worker[:255]
            row.lease_token = lease.token
        self.rows[row.id] = created(row, "fan_out")
        return row

    # --- claims ----------------------------------------------------------------

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
        """As :meth:`Gateway.claim <outbox_app.store.gateway.Gateway.claim>`."""
        token = uuid.uuid4()
        expiry = now + datetime.timedelta(seconds=lease_seconds)
        with self._lock:
            self.statements.append("claim")
            due = [
                r
                for r in self.rows.values()
                if r.subscriber in names
                and r.state in CLAIMABLE
                and r.next_retry_at <= now
                and not (ordered and self._held(r, event_types))
            ]
            due.sort(key=lambda r: (r.next_retry_at, r.id))
            taken = _within_budget(
                due[:limit], max_bytes, 1, lambda r: r.event.payload_bytes
            )
            for row in taken:
                moved(row, "claim", State.RUNNING)
                row.attempts += 1
                row.lease_token = token
                row.locked_by = worker[:255]
                row.locked_until = row.next_retry_at = expiry
                row.updated_at = now
            return token, [
                _context(r, self.using) for r in sorted(taken, key=lambda r: r.id)
            ]

    def _held(self, row: Row, event_types: frozenset[str] | None) -> bool:
        """An ordered subscriber's row waits: an earlier unfinished row of its
        (subscriber, aggregate), or an earlier event of its aggregate (of
        ``event_types``) still awaiting fan-out."""
        key = row.aggregate
        if key is None:
            return False
        position = row.event.position
        earlier_row = any(
            u.subscriber == row.subscriber
            and u.aggregate == key
            and u.state in UNFINISHED
            and u.event.position < position
            for u in self.rows.values()
        )
        earlier_event = any(
            e.fanned_out is False
            and (e.aggregate_type, e.aggregate_id) == key
            and (event_types is None or e.event_type in event_types)
            and e.position < position
            for e in self.events.values()
        )
        return earlier_row or earlier_event

    # --- outcomes (compare-and-set on the lease token) ---------------------------

    def _fenced(self, token: uuid.UUID, ids: Iterable[int]) -> list[Row]:
        """The rows of ``ids`` still held under ``token``."""
        return [
            row
            for row in (self.rows.get(i) for i in ids)
            if row is not None
            and row.lease_token == token
            and row.state == State.RUNNING
        ]

    def renew(
        self, token: uuid.UUID, ids: Sequence[int], expiry: datetime.datetime, now
    ) -> set[int]:
        """As :meth:`Gateway.renew <outbox_app.store.gateway.Gateway.renew>`."""
        with self._lock:
            self.statements.append("renew")
            held = self._fenced(token, ids)
            for row in held:
                row.locked_until = row.next_retry_at = expiry
                row.updated_at = now
            return {row.id for row in held}

    def succeed(
        self, token: uuid.UUID, ids: Sequence[int], now: datetime.datetime
    ) -> int:
        """As :meth:`Gateway.succeed <outbox_app.store.gateway.Gateway.succeed>`."""
        with self._lock:
            self.statements.append("succeed")
            held = self._fenced(token, ids)
            for row in held:
                moved(row, "succeed", State.SUCCEEDED)
                row.completed_at = row.updated_at = now
                row.locked_until = row.lease_token = None
            return len(held)

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
        """As :meth:`Gateway.fail <outbox_app.store.gateway.Gateway.fail>`."""
        with self._lock:
            self.statements.append("fail")
            held = self._fenced(token, [delivery_id])
            for row in held:
                dead = retry_at is None
                if dead:
                    moved(row, "die", State.DEAD)
                else:
                    moved(row, "fail", State.FAILED)
                row.last_error, row.last_traceback = error, traceback
                row.last_error_type = error_type[:255]
                row.first_failed_at = row.first_failed_at or now
                row.next_retry_at = retry_at or row.next_retry_at
                row.completed_at = now if dead else None
                row.locked_until = row.lease_token = None
                row.updated_at = now
            return bool(held)

    def release(
        self,
        token: uuid.UUID,
        ids: Sequence[int],
        now: datetime.datetime,
        due: datetime.datetime | None = None,
    ) -> int:
        """As :meth:`Gateway.release <outbox_app.store.gateway.Gateway.release>`."""
        with self._lock:
            self.statements.append("release")
            held = self._fenced(token, ids)
            for row in held:
                failed_before = row.attempts > 1
                moved(row, "release", State.FAILED if failed_before else State.PENDING)
                row.attempts -= 1
                row.next_retry_at = due or now
                row.locked_until = row.lease_token = None
                row.locked_by = ""
                row.updated_at = now
            return len(held)

    def lapse(
        self,
        token: uuid.UUID,
        ids: Sequence[int],
        *,
        error: str,
        error_type: str,
        now: datetime.datetime,
    ) -> int:
        """As :meth:`Gateway.lapse <outbox_app.store.gateway.Gateway.lapse>`."""
        with self._lock:
            self.statements.append("lapse")
            held = self._fenced(token, ids)
            for row in held:
                moved(row, "lapse", State.SKIPPED)
                row.attempts -= 1
                row.last_error, row.last_error_type = error, error_type[:255]
                row.last_traceback = ""
                row.completed_at = row.updated_at = now
                row.locked_until = row.lease_token = None
            return len(held)


class MemoryView:
    """What a relay reads of the subscriptions between batches
    (:class:`outbox_app.relay.loop.SubscriptionView`), without a database:
    the subscribers an operator paused (``held``), every event type
    subscribed, and events awaiting fan-out (row delivery)."""

    def __init__(self, held: Iterable[str] = ()):
        self.held = set(held)

    def types(self, subscribers) -> frozenset[str] | None:
        return None

    def awaiting_fanout(self) -> bool:
        return True

    def close(self) -> None:
        pass


def _within_budget(rows: list, max_bytes: int, at_least: int, size) -> list:
    """The first of ``rows`` whose ``size(row)`` (payload bytes) add up to at
    most ``max_bytes``, and at least the first ``at_least`` of them (the
    SQL's running sum)."""
    kept, running = [], 0
    for n, row in enumerate(rows, 1):
        running += size(row)
        if running <= max_bytes or n <= at_least:
            kept.append(row)
        else:
            break
    return kept


def _context(row: Row, using: str) -> DeliveryContext:
    e = row.event
    return DeliveryContext(
        event_id=e.id,
        namespace=e.namespace,
        event_type=e.event_type,
        revision=e.revision,
        payload=e.payload,
        aggregate_type=e.aggregate_type,
        aggregate_id=e.aggregate_id,
        aggregate_version=e.aggregate_version,
        headers=e.headers,
        tenant_id=e.tenant_id,
        action_id=e.action_id,
        occurred_at=e.occurred_at,
        attempt=row.attempts,
        subscriber=row.subscriber,
        delivery_id=row.id,
        deliver_at=e.deliver_at,
        expires_at=e.expires_at,
        operation=e.operation,
        payload_bytes=e.payload_bytes,
        using=using,
        position=None,
    )
