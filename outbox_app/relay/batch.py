"""A claimed batch: its lease, kept and renewed, and claiming the next batch
ahead while this one is delivered.

The lease rules live here, once. A batch's rows are leased for
``OUTBOX_LEASE_SECONDS`` from their claim. Before the relay acts on rows
(runs a group of handlers, sends a publisher batch) it calls
:meth:`Batch.keep`: once a tenth of the lease has passed since the rows were
last leased, they are re-leased, and the rows another relay took over
meanwhile (their lease ran out during a stall) are dropped from the batch and
never run by this relay. A relay that knows its lease may have run out (more
than a lease since the last renewal) does not start another handler before it
has renewed.
"""

from __future__ import annotations

import datetime
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from django.db import connections

from ..conf import outbox_settings
from ..exceptions import LeaseLost
from ..store.clock import database_now
from ..store.gateway import Gateway, Lease
from ..store.sql import dialect
from ..subscribers import DeliveryContext, Subscriber
from .outcomes import Outcomes, RelayReport


@dataclass
class Batch:
    """Rows claimed for one subscriber under one lease token.

    Attributes:
        contexts: the claimed deliveries, in delivery id order.
        now: the claim's clock (the database's, :func:`~outbox_app.store.db.
            database_now`, or a test's); :meth:`clock` moves it on with the
            time spent.
        started: ``time.monotonic()`` at the claim.
        renewed: ``time.monotonic()`` when the rows were last leased.
        payload_bytes: the claimed rows' payload bytes (as published).
    """

    subscriber: Subscriber
    gateway: Gateway
    token: uuid.UUID
    contexts: list[DeliveryContext]
    now: datetime.datetime
    started: float
    renewed: float
    fanned_out: int = 0
    payload_bytes: int = 0

    @classmethod
    def claim(
        cls,
        subscriber: Subscriber,
        using: str,
        batch_size: int,
        now: datetime.datetime | None,
        worker: str,
        fold: Fold | None = None,
        gateway: Gateway | None = None,
    ) -> Batch:
        """Lease up to ``batch_size`` due rows of ``subscriber`` and read what
        delivering them needs (one round trip where the database allows),
        their payloads adding up to at most ``OUTBOX_BATCH_BYTES`` (a first
        row larger than that is taken alone).

        With ``fold`` (an unordered subscriber), a batch that is not full is
        topped up from events not fanned out yet, fanning them out and
        claiming ``subscriber``'s share in the same step
        (:meth:`Gateway.fan_out` with a lease), within what is left of the
        byte budget: due rows first, so retries are never starved by new
        events.

        ``gateway``: the statements sent (default :class:`Gateway` of
        ``using``; a test may hand in a store of its own).
        """
        started = time.monotonic()
        now = now or database_now(using)
        gateway = gateway or Gateway(using)
        lease = outbox_settings.LEASE_SECONDS
        budget = outbox_settings.BATCH_BYTES
        token, contexts = gateway.claim(
            subscriber.stored_names,
            limit=batch_size,
            lease_seconds=lease,
            worker=worker,
            now=now,
            ordered=subscriber.ordered,
            event_types=subscriber.event_types,
            max_bytes=budget,
        )
        left = budget - sum(c.payload_bytes for c in contexts)
        fanned_out = 0
        if (
            fold is not None
            and fold.types != frozenset()  # nothing subscribed
            and not subscriber.ordered
            and len(contexts) < batch_size
            and (left > 0 or not contexts)
        ):
            expiry = now + datetime.timedelta(seconds=lease)
            step = gateway.fan_out(
                fold.types,
                batch_size - len(contexts),
                fold.after,
                now,
                Lease(
                    subscriber.name,
                    token,
                    worker,
                    expiry,
                    max_bytes=left,
                    at_least_one=not contexts,
                ),
            )
            if step.scanned:
                fold.after = step.scanned[-1]
            fanned_out = step.fanned_out
            # Where the fan-out reads its claimed rows back by lease token
            # (not PostgreSQL's RETURNING), a row this claim took already (a
            # replayed delivery of an event not fanned out yet) comes back too.
            taken = {c.delivery_id for c in contexts}
            contexts += [c for c in step.contexts if c.delivery_id not in taken]
        return cls(
            subscriber,
            gateway,
            token,
            contexts,
            now,
            started,
            started,
            fanned_out,
            sum(c.payload_bytes for c in contexts),
        )

    def __len__(self) -> int:
        return len(self.contexts)

    def near_budget(self) -> bool:
        """Whether the byte budget may have cut this batch short: its payloads
        leave less room under ``OUTBOX_BATCH_BYTES`` than one payload may
        take (``OUTBOX_MAX_PAYLOAD_BYTES``), so rows may wait behind it."""
        room = outbox_settings.BATCH_BYTES - self.payload_bytes
        return self.payload_bytes > 0 and room < outbox_settings.MAX_PAYLOAD_BYTES

    def take_lapsed(self) -> list[DeliveryContext]:
        """Remove from the batch, and return, the rows whose event expired
        (``expires_at``) by the claim's clock: they are never delivered."""
        kept, lapsed = [], []
        for c in self.contexts:
            expired = c.expires_at is not None and c.expires_at <= self.now
            (lapsed if expired else kept).append(c)
        self.contexts = kept
        return lapsed

    def clock(self) -> datetime.datetime:
        """The batch's clock now: its claim time plus the time spent since (so a
        test's fixed clock moves on as the batch runs)."""
        return self.now + datetime.timedelta(seconds=time.monotonic() - self.started)

    def lease_may_have_run_out(self) -> bool:
        """More than a lease has passed since the rows were last leased."""
        return time.monotonic() - self.renewed >= outbox_settings.LEASE_SECONDS

    def keep(self, contexts: Sequence[DeliveryContext]) -> list[DeliveryContext]:
        """The ``contexts`` this batch still holds, re-leased for a whole lease
        if a tenth of it has passed since they were last leased.

        Rows another relay holds now are left out (the caller counts them as
        lost); they are never run by this relay.
        """
        lease = outbox_settings.LEASE_SECONDS
        if time.monotonic() - self.renewed <= lease / 10 or not contexts:
            return list(contexts)
        renewed = time.monotonic()
        held = self.renew([c.delivery_id for c in contexts])
        self.renewed = renewed
        return [c for c in contexts if c.delivery_id in held]

    def renew(self, ids: Sequence[int]) -> set[int]:
        """Lease the rows ``ids`` of this batch for a whole lease from now.
        Returns the ids still held (the others were taken over)."""
        clock = self.clock()
        expiry = clock + datetime.timedelta(seconds=outbox_settings.LEASE_SECONDS)
        return self.gateway.renew(self.token, ids, expiry, clock)

    def outcomes(self, report: RelayReport) -> Outcomes:
        """Where this batch's outcomes are written and counted."""
        return Outcomes(self.gateway, self.subscriber, self.token, report)

    def settlement(self, outcomes: Outcomes) -> RowSettlement:
        return RowSettlement(self, outcomes)

    def release(self) -> RelayReport:
        """Hand every row back unattempted (a batch claimed ahead that is not
        needed: shutting down, time is up), due as of the claim, as they
        were: the batch's clock runs on the process's monotonic clock, which
        a host's wall clock (SQLite's) may trail by milliseconds, and a row
        due that far ahead would not be claimed by a relay that looks at
        once."""
        if not self.contexts:
            return RelayReport()
        released = self.gateway.release(
            self.token,
            [c.delivery_id for c in self.contexts],
            self.clock(),
            due=self.now,
        )
        return RelayReport(
            claimed=len(self.contexts), released=released, fanned_out=self.fanned_out
        )


class RowSettlement:
    """Writes what happened to a claimed :class:`Batch`, row by row, each
    write a compare-and-set on the batch's lease token (the runners call the
    same methods of a stream batch's settlement,
    :class:`~outbox_app.relay.stream.StreamSettlement`)."""

    def __init__(self, batch: Batch, outcomes: Outcomes):
        self.batch = batch
        self.outcomes = outcomes

    def skip(self, context: DeliveryContext) -> bool:
        """Rows are claimed in order already: none is set aside."""
        return False

    def hold(self, context: DeliveryContext) -> None:
        """An ordered subscriber's claim takes one row per aggregate: nothing
        of its aggregate follows in the batch."""

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
        """Mark a handler group's successes SUCCEEDED: ``inside`` its
        transaction (all or none: :class:`~outbox_app.exceptions.LeaseLost`
        when a row was taken over; with ``fence_deferred`` the rows of the
        handlers whose callbacks run later are fenced too, by renewing
        them), or alone. Failures are written once it committed
        (:meth:`recorded`). Returns ``(failures, deferred)``."""
        if not inside:
            self.outcomes.succeeded(succeeded)
            return failures, deferred
        self.outcomes.succeeded(succeeded, all_or_none=True)
        later_ids = [c.delivery_id for c in deferred]
        if (
            fence_deferred
            and later_ids
            and len(self.batch.renew(later_ids)) < len(later_ids)
        ):
            raise LeaseLost("leases of handlers with callbacks lost")
        return failures, deferred

    def recorded(self, failures) -> None:
        """Write each failed attempt (FAILED, or DEAD) and log it."""
        for context, error, retry_at in failures:
            self.outcomes.failed(context, error, retry_at)

    def abandoned(self, failures) -> None:
        """The group's transaction is gone: its failures are still written
        where the connection allows."""
        self.recorded(failures)

    def lost(self, held: list[DeliveryContext]) -> None:
        """A group rolled back because a lease was lost: the rows still held
        are handed back, due at once; the others are another relay's now."""
        ids = [c.delivery_id for c in held]
        released = self.outcomes.released(ids)
        self.outcomes.lost(len(ids) - released, "ran in a rolled-back group")

    def stopped(self, waiting: list[DeliveryContext]) -> None:
        """The relay stops: rows not attempted yet are handed back."""
        self.outcomes.released([c.delivery_id for c in waiting])

    def finish(self) -> None:
        """Nothing is left to write once every row's outcome is."""

    def deferred_outcomes(self) -> Outcomes:
        return self.outcomes

    def sent(
        self,
        delivered: list[DeliveryContext],
        outages: list[DeliveryContext],
        failures: list,
        mark,
    ) -> None:
        """A publisher's batch came back: ``delivered`` are marked SUCCEEDED
        (by ``mark``, which may write them on another connection), the rows
        of ``outages`` are handed back unattempted, ``failures`` written."""
        mark(self.outcomes, delivered)
        if outages:
            self.outcomes.released([c.delivery_id for c in outages])
        self.recorded(failures)


@dataclass
class Fold:
    """Fan-out folded into claims for one :func:`deliver` call: the event
    types some active subscription receives (``None``: every type; see
    :func:`~outbox_app.relay.fanout.subscribed_types`), and where its last
    batch ended (keyset paging; an event committed late with a lower id is
    left to the next fan-out)."""

    types: frozenset[str] | None
    after: uuid.UUID | None = None


class Sidecar:
    """A thread with a database connection of its own, for database work that
    can overlap the relay's own (a claim ahead, a batch's SUCCEEDED mark).

    Only where a second connection helps and sees the same data: not on SQLite
    (one writer at a time) and not inside an outer transaction (a caller's
    ``atomic()``, a test case); there ``enabled`` is False and callers do the
    work inline. The thread starts on first use and lives for one
    :func:`~outbox_app.relay.deliver` call: :meth:`close` closes its
    connection.
    """

    def __init__(self, using: str, name: str):
        self.using = using
        self.name = name
        self.enabled = not (
            dialect(using).single_writer or connections[using].in_atomic_block
        )
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable, *args) -> Future:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix=self.name)
        return self._executor.submit(fn, *args)

    def close(self) -> None:
        if self._executor is not None:
            # Looked up in the thread: its own connection, not the caller's.
            self._executor.submit(lambda: connections[self.using].close()).result()
            self._executor.shutdown()
            self._executor = None


class ClaimAhead:
    """Claims a subscriber's next batch on a second connection
    (:class:`Sidecar`) while the current batch is delivered: the database work
    of a claim overlaps the handlers' or the broker's (docs/performance.md).

    Not for ordered subscribers (see ``submit``). It starts only once a full
    batch shows a backlog. A batch claimed ahead is renewed before it is
    delivered if it waited long (:meth:`Batch.keep`).
    """

    def __init__(self, using: str):
        self.sidecar = Sidecar(using, "outbox-claim")
        self.pending: tuple[Subscriber, Future[Batch]] | None = None

    def submit(self, subscriber: Subscriber, claim: Callable[[Subscriber], Batch]):
        if not self.sidecar.enabled or self.pending is not None or subscriber.ordered:
            # An ordered subscriber's next heads appear only once this batch
            # is finished: claimed ahead, they would come back short or empty.
            return
        self.pending = (subscriber, self.sidecar.submit(claim, subscriber))

    def take(self, subscriber: Subscriber) -> Batch | None:
        """The batch claimed ahead for ``subscriber``, if that is what was
        claimed.

        Raises:
            django.db.DatabaseError: the claim failed.
        """
        if self.pending is None or self.pending[0] is not subscriber:
            return None
        future = self.pending[1]
        self.pending = None
        return future.result()

    def close(self) -> RelayReport:
        """Release a batch claimed ahead and not delivered; close the thread's
        connection."""
        report = RelayReport()
        if self.pending is not None:
            future = self.pending[1]
            self.pending = None
            if future.exception() is None:
                report = future.result().release()
        self.sidecar.close()
        return report
