"""The relay's steps as plain functions: fan out, claim, deliver, record.

The ``relay`` management command, the Celery tasks and the tests call these;
each is bounded by a batch size and a time budget and returns counts.

Delivery of one claimed batch:

* **handlers** run in groups: one transaction per group, each handler in a
  savepoint, then one compare-and-set UPDATE marks the group's successful rows
  SUCCEEDED. A handler's database writes and its mark commit together, so a
  handler that only touches the database takes effect exactly once; a failing
  handler's savepoint is rolled back and its failure recorded after the group
  commits; if any row of the group lost its lease meanwhile, the whole group
  rolls back. A group closes after a handler that queried the database (so
  its locks are released with it, as if it ran alone) or after
  ``GROUP_SECONDS`` (a tenth of the lease, if less): handlers that do not touch
  the database share one commit, the others get one each;
* a **publisher** gets the whole batch (``send_batch``); rows it confirms become
  SUCCEEDED in one UPDATE, the others FAILED with the reason.

No transaction or row lock is open while a broker call runs, and none but
the group's own while handlers run. Under a backlog (a full batch), the next
batch is claimed on a second connection while this one is delivered
(PostgreSQL, MySQL/MariaDB; see ``_ClaimAhead``).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from datetime import datetime, timedelta
from typing import Any

from django.db import DatabaseError, connections, transaction
from django.utils import timezone

from . import registry
from .backoff import retry_delay
from .conf import outbox_settings
from .db import is_single_writer
from .events import decode, event_class
from .exceptions import DeliveryError, HandlerTimeout, LeaseLost
from .fanout import fan_out
from .models import Notification
from .registry import DeliveryContext, Handler, Kind, Subscriber

logger = logging.getLogger("outbox_app.relay")

#: Longest a group of handlers shares one transaction, in seconds (a group
#: always runs at least one handler). Short enough that a group's locks and its
#: outcomes' visibility wait little; long enough that no-op handlers share one
#: commit per batch (bench/RESULTS.md, benchmark 3).
GROUP_SECONDS = 0.1

__all__ = ["RelayReport", "deliver", "fan_out", "relay_once", "worker_name"]


@dataclass
class RelayReport:
    """Counts of one relay call (rows, not events).

    Attributes:
        fanned_out: events turned into notifications.
        claimed: notifications leased.
        succeeded, failed, expired: outcomes written (FAILED will be retried).
        lost: outcomes discarded because the lease had passed to another worker.
        released: claimed rows handed back unattempted (shutdown).
    """

    fanned_out: int = 0
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    expired: int = 0
    lost: int = 0
    released: int = 0

    def __iadd__(self, other: RelayReport) -> RelayReport:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def worker_name() -> str:
    """``host:pid``, stored as ``locked_by`` on leased rows."""
    return f"{socket.gethostname()}:{os.getpid()}"


def relay_once(
    *,
    kind: Kind | None = None,
    using: str = "default",
    batch_size: int | None = None,
    max_seconds: float | None = None,
    now: datetime | None = None,
    stop: threading.Event | None = None,
) -> RelayReport:
    """Fan out, then deliver what is due, once.

    Args:
        kind: ``"handler"`` or ``"publisher"`` to deliver to one kind only;
            ``None`` for both.
        using: database alias.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: time budget in seconds for the whole call; ``None``: until
            nothing is due.
        now: the clock for claims and backoff (tests); default the real time.
        stop: when set (a relay shutting down), no new batch is claimed and the
            unattempted rows of the current handler batch are released.

    Returns:
        RelayReport with the counts.
    """
    started = time.monotonic()
    report = RelayReport(
        fanned_out=fan_out(using=using, batch_size=batch_size, max_seconds=max_seconds)
    )
    remaining = (
        None if max_seconds is None else max_seconds - (time.monotonic() - started)
    )
    report += deliver(
        kind=kind,
        using=using,
        batch_size=batch_size,
        max_seconds=remaining,
        now=now,
        stop=stop,
    )
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
) -> RelayReport:
    """Claim and deliver due notifications, batch by batch, until none is due or
    the time budget is spent.

    Args:
        subscribers: whom to deliver for; default every subscriber of ``kind``.
        kind: ``"handler"``, ``"publisher"`` or ``None`` (both), when
            ``subscribers`` is not given.
        using: database alias.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop claiming new batches after this many seconds; ``None``
            runs until nothing is due. A batch already claimed is finished.
        now: the clock for claims and backoff (tests); default the real time,
            read per batch.
        worker: lease holder name; default :func:`worker_name`.
        rng: randomness for backoff jitter (tests).
        stop: when set, claim no new batch; a handler batch releases the rows
            it has not attempted yet (due again at once, attempt taken back).

    Returns:
        RelayReport with the counts (``fanned_out`` is 0).

    Raises:
        django.db.DatabaseError: the database failed outside a delivery (during
            a claim); outcomes already written stay written.
    """
    chosen = list(registry.subscribers(kind) if subscribers is None else subscribers)
    batch_size = batch_size or outbox_settings.BATCH_SIZE
    worker = worker or worker_name()
    deadline = None if max_seconds is None else time.monotonic() + max_seconds
    stop = stop or threading.Event()
    report = RelayReport()
    ahead = _ClaimAhead(using)

    def claim(subscriber: Subscriber) -> _Batch:
        return _Batch.claim(subscriber, using, batch_size, now, worker)

    delivering = 0.0  # seconds the last batch took to deliver
    try:
        active = chosen
        while active:
            still_busy: list[Subscriber] = []
            for position, subscriber in enumerate(active):
                if stop.is_set():
                    return report
                batch = ahead.take(subscriber) or claim(subscriber)
                # A full batch may have more behind it; so may any batch of an
                # ordered subscriber, which claims only each aggregate's head.
                if len(batch.rows) == batch_size or (subscriber.ordered and batch.rows):
                    still_busy.append(subscriber)
                    # A backlog: claim the next batch on a second connection
                    # while this one is delivered (unless time is up by then).
                    following = active[position + 1 : position + 2] or still_busy
                    if deadline is None or time.monotonic() + delivering < deadline:
                        ahead.submit(following[0], claim)
                began = time.monotonic()
                report += batch.deliver(rng, stop)
                delivering = time.monotonic() - began
                if deadline is not None and time.monotonic() >= deadline:
                    return report
            active = still_busy
        return report
    finally:
        # A batch claimed ahead and not delivered (time is up, stopping, an
        # error) is handed back.
        report += ahead.close()


@dataclass
class _Batch:
    """Rows claimed for one subscriber under one lease token."""

    subscriber: Subscriber
    using: str
    token: Any
    rows: list[Notification]
    now: datetime
    started: float  # time.monotonic() when ``now`` was read, give or take

    @classmethod
    def claim(
        cls,
        subscriber: Subscriber,
        using: str,
        batch_size: int,
        now: datetime | None,
        worker: str,
    ) -> _Batch:
        """Lease up to ``batch_size`` due rows and read what delivery needs."""
        started = time.monotonic()
        now = now or timezone.now()
        rows = Notification.objects.using(using).for_subscribers(
            subscriber.stored_names
        )
        token, ids = rows.claim(
            limit=batch_size,
            lease_seconds=outbox_settings.LEASE_SECONDS,
            worker=worker,
            ordered=subscriber.ordered,
            now=now,
        )
        claimed = (
            list(
                Notification.objects.using(using)
                .filter(id__in=ids)
                .select_related("event")
                .only(*CLAIMED_FIELDS)
                .order_by("id")
            )
            if ids
            else []
        )
        return cls(subscriber, using, token, claimed, now, started)

    def deliver(self, rng: random.Random | None, stop: threading.Event) -> RelayReport:
        if not self.rows:
            return RelayReport()
        outcome = _Outcome(
            self.subscriber, self.token, self.using, self.now, rng, self.started
        )
        if isinstance(self.subscriber, Handler):
            outcome.run_handlers(self.subscriber, self.rows, stop)
        else:
            outcome.run_publisher(self.rows)
        outcome.report.claimed = len(self.rows)
        return outcome.report

    def release(self) -> RelayReport:
        """Hand the rows back unattempted (shutting down, time is up)."""
        if not self.rows:
            return RelayReport()
        released = (
            Notification.objects.using(self.using)
            .filter(id__in=[row.id for row in self.rows])
            .release(self.token)
        )
        return RelayReport(claimed=len(self.rows), released=released)


class _ClaimAhead:
    """Claims a subscriber's next batch on a second connection, in a thread,
    while the current batch is delivered: the database work of a claim overlaps
    the handlers' or the broker's (bench/RESULTS.md, benchmarks 2 and 3).

    Not for ordered subscribers (see ``submit``), and only where a second
    connection helps and sees the same data: not on SQLite
    (one writer at a time) and not inside an outer transaction (a caller's
    ``atomic()``, a test case), where claims stay on the caller's connection.
    The thread and its connection live for one :func:`deliver` call and start
    only once a full batch shows a backlog.
    """

    def __init__(self, using: str):
        self.using = using
        self.enabled = not (
            is_single_writer(using) or connections[using].in_atomic_block
        )
        self.executor: ThreadPoolExecutor | None = None
        self.pending: tuple[Subscriber, Future[_Batch]] | None = None

    def submit(self, subscriber: Subscriber, claim: Callable[[Subscriber], _Batch]):
        if not self.enabled or self.pending is not None or subscriber.ordered:
            # An ordered subscriber's next heads appear only once this batch
            # is finished: claimed ahead, they would come back short or empty.
            return
        if self.executor is None:
            self.executor = ThreadPoolExecutor(1, thread_name_prefix="outbox-claim")
        self.pending = (subscriber, self.executor.submit(claim, subscriber))

    def take(self, subscriber: Subscriber) -> _Batch | None:
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
        if self.executor is not None:
            # Looked up in the thread: its own connection, not this one's.
            self.executor.submit(lambda: connections[self.using].close()).result()
            self.executor.shutdown()
        return report


class _Outcome:
    """Writes the outcomes of one claimed batch (all compare-and-set on the
    batch's lease token)."""

    def __init__(self, subscriber, token, using, now, rng, started=None):
        self.subscriber = subscriber
        self.token = token
        self.using = using
        self.now = now
        self.rng = rng
        self.report = RelayReport()
        self._started = time.monotonic() if started is None else started

    def clock(self) -> datetime:
        """The batch's clock now: its claim time plus the time spent since (so a
        test's fixed clock moves on as the batch runs)."""
        return self.now + timedelta(seconds=time.monotonic() - self._started)

    def _row(self, row: Notification):
        return Notification.objects.using(self.using).filter(id=row.id)

    def run_handlers(
        self, handler: Handler, rows: list[Notification], stop: threading.Event
    ) -> None:
        """Run ``handler`` on the claimed ``rows``, in order, group by group.

        Before each group the rows still waiting are re-leased when a tenth of
        the lease has passed, so every handler starts with at least 90% of a
        lease ahead of it. When ``stop`` is set, the rows not attempted yet are
        released instead.
        """
        lease = outbox_settings.LEASE_SECONDS
        renewed_at = self._started
        position = 0
        while position < len(rows):
            waiting = Notification.objects.using(self.using).filter(
                id__in=[row.id for row in rows[position:]]
            )
            if stop.is_set():
                self.report.released = waiting.release(self.token)
                return
            if time.monotonic() - renewed_at > lease / 10:
                renewed_at = time.monotonic()
                waiting.renew(self.token, lease, self.clock())
            position += self._run_group(
                handler, rows[position:], min(GROUP_SECONDS, lease / 10), stop
            )

    def _run_group(
        self,
        handler: Handler,
        rows: list[Notification],
        seconds: float,
        stop: threading.Event,
    ) -> int:
        """Run handlers on a prefix of ``rows`` in one transaction, for about
        ``seconds``; record the outcomes. Returns how many rows it took."""
        succeeded: list[int] = []
        failures: list[tuple[Notification, BaseException, bool]] = []
        taken = 0
        try:
            with transaction.atomic(using=self.using):
                deadline = time.monotonic() + seconds
                for row in rows:
                    if taken and (time.monotonic() >= deadline or stop.is_set()):
                        break
                    taken += 1
                    if row.attempts > handler.attempts_allowed:
                        # The lease ran out on the last allowed attempt: the
                        # worker died or hung. Do not run it again.
                        error = LeaseLost(
                            f"attempt {row.attempts - 1} of "
                            f"{handler.attempts_allowed} never finished: its "
                            "worker died or hung past the lease"
                        )
                        failures.append((row, error, True))
                        continue
                    error, queried = self._run_one(handler, row)
                    if error is None:
                        succeeded.append(row.id)
                    else:
                        give_up = isinstance(
                            error, handler.give_up_on
                        ) or not isinstance(error, handler.retry_on)
                        expire = give_up or row.attempts >= handler.attempts_allowed
                        failures.append((row, error, expire))
                    if queried:
                        # Its locks are held until the commit: commit now, so no
                        # lock outlives its handler (two workers' groups would
                        # otherwise deadlock on an application's hot rows).
                        break
                # The compare-and-set of the whole group: it marks only rows
                # still leased under this batch's token, and locks them until
                # the commit.
                marked = (
                    Notification.objects.using(self.using)
                    .filter(id__in=succeeded)
                    .succeed(self.token, timezone.now())
                    if succeeded
                    else 0
                )
                if marked < len(succeeded):
                    raise LeaseLost(f"{len(succeeded) - marked} leases lost")
        except LeaseLost:
            # A handler outran the lease and another worker claimed its row:
            # every write of the group is rolled back, the rows still held are
            # handed back, due at once; the others belong to that worker now.
            released = (
                Notification.objects.using(self.using)
                .filter(id__in=succeeded)
                .release(self.token)
            )
            self.report.released += released
            self.report.lost += len(succeeded) - released
            logger.warning(
                "%s: %d of %d notifications lost their lease while their group "
                "ran; the group's writes were rolled back and %d rows handed back",
                handler.name,
                len(succeeded) - released,
                len(succeeded),
                released,
            )
        else:
            self.report.succeeded += len(succeeded)
        for row, error, expire in failures:
            self.failed(row, error, expire=expire)
        return taken

    def _run_one(
        self, handler: Handler, row: Notification
    ) -> tuple[Exception | None, bool]:
        """Run one handler in its own savepoint: (its error or None, whether it
        queried the database)."""

        def call() -> None:
            event = _event_for(row)
            with _time_limit(handler.timeout) as timer:
                handler.fn(event, context_for(row))
            if timer.fired:  # the handler caught HandlerTimeout and returned
                raise HandlerTimeout(
                    f"handler ran longer than its timeout of {handler.timeout}s"
                )

        return _in_savepoint(connections[self.using], call)

    def run_publisher(self, rows: list[Notification]) -> None:
        publisher = self.subscriber
        fresh = []
        for row in rows:
            if row.attempts > publisher.attempts_allowed:
                self.failed(
                    row,
                    LeaseLost("its worker died or hung past the lease"),
                    expire=True,
                )
            else:
                fresh.append(row)
        if not fresh:
            return
        try:
            outcomes = list(publisher.send_batch([context_for(r) for r in fresh]))
            if len(outcomes) != len(fresh):
                raise RuntimeError(
                    f"{type(publisher).__name__}.send_batch returned {len(outcomes)} "
                    f"outcomes for {len(fresh)} messages"
                )
        except Exception as exc:
            outcomes = [exc] * len(fresh)
        outcomes = [
            o
            if o is None or isinstance(o, BaseException)
            else DeliveryError(f"{type(publisher).__name__} reported {o!r}")
            for o in outcomes
        ]
        delivered = [
            row.id for row, error in zip(fresh, outcomes, strict=True) if error is None
        ]
        if delivered:
            written = (
                Notification.objects.using(self.using)
                .filter(id__in=delivered)
                .succeed(self.token, timezone.now())
            )
            self.report.succeeded += written
            if written < len(delivered):
                self.report.lost += len(delivered) - written
                logger.warning(
                    "%s: %d delivered rows had lost their lease; another worker "
                    "owns them now",
                    publisher.name,
                    len(delivered) - written,
                )
        for row, error in zip(fresh, outcomes, strict=True):
            if error is not None:
                self.failed(
                    row, error, expire=row.attempts >= publisher.attempts_allowed
                )

    def failed(self, row: Notification, exc: BaseException, *, expire: bool) -> None:
        retry_at = None
        if not expire:
            delay = retry_delay(
                row.attempts,
                outbox_settings.RETRY_BASE_SECONDS,
                outbox_settings.RETRY_MAX_SECONDS,
                self.rng,
            )
            retry_at = self.clock() + timedelta(seconds=delay)
        limit = outbox_settings.TRACEBACK_MAX_CHARS
        text = "".join(traceback.format_exception(exc))
        try:
            written = self._row(row).fail(
                self.token,
                # PostgreSQL text cannot hold NUL characters.
                error=(str(exc) or repr(exc)).replace("\x00", "\\x00"),
                error_type=f"{type(exc).__module__}.{type(exc).__qualname__}",
                traceback=(text[-limit:] if limit else "").replace("\x00", "\\x00"),
                retry_at=retry_at,
                now=timezone.now(),
            )
        except DatabaseError:
            # The row stays RUNNING and is retried once its lease runs out; the
            # rest of the batch goes on.
            logger.exception(
                "%s: could not record the failure of notification %s: %s",
                self.subscriber.name,
                row.id,
                exc,
            )
            return
        if not written:
            self.lost(row)
            return
        if expire:
            self.report.expired += 1
            logger.error(
                "%s: notification %s of event %s EXPIRED after %d attempt(s): %s",
                self.subscriber.name,
                row.id,
                row.event_id,
                row.attempts,
                exc,
            )
        else:
            self.report.failed += 1
            logger.warning(
                "%s: notification %s of event %s failed (attempt %d), retry at %s: %s",
                self.subscriber.name,
                row.id,
                row.event_id,
                row.attempts,
                retry_at.isoformat(),
                exc,
            )

    def lost(self, row: Notification) -> None:
        self.report.lost += 1
        logger.warning(
            "%s: lease on notification %s was lost; its outcome was discarded "
            "(another worker owns the row now)",
            self.subscriber.name,
            row.id,
        )


#: What delivery reads of a claimed row and its event (context_for, the
#: outcome writers): the rest (timestamps, errors, action details) is left
#: unread, which makes reading a batch about twice as fast.
CLAIMED_FIELDS = (
    "id",
    "attempts",
    "subscriber",
    "event_id",
    *(
        f"event__{name}"
        for name in (
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
        )
    ),
)


def context_for(row: Notification) -> DeliveryContext:
    """The DeliveryContext of a claimed row (``row.event`` selected with it)."""
    event = row.event
    return DeliveryContext(
        event_id=event.id,
        namespace=event.namespace,
        event_type=event.event_type,
        revision=event.revision,
        payload=event.payload,
        aggregate_type=event.aggregate_type,
        aggregate_id=event.aggregate_id,
        aggregate_version=event.aggregate_version,
        headers=event.headers,
        tenant_id=event.tenant_id,
        action_id=event.action_id,
        occurred_at=event.occurred_at,
        attempt=row.attempts,
        subscriber=row.subscriber,
        notification_id=row.id,
    )


def _event_for(row: Notification) -> Any:
    """The event a handler receives: the Event instance, or the payload dict for
    a type no class defines."""
    event = row.event
    if event_class(event.event_type) is None:
        return event.payload
    return decode(event.event_type, event.revision, event.payload)


def _in_savepoint(connection, fn: Callable[[], None]) -> tuple[Exception | None, bool]:
    """Call ``fn()`` as a nested ``transaction.atomic()`` would, inside the
    group's transaction, but send the SAVEPOINT only before ``fn``'s first query
    on ``connection``: a handler that never touches this database (an e-mail, a
    cache, an HTTP call) costs no round trip, which is most of what a no-op
    handler costs otherwise (bench/RESULTS.md, benchmark 3).

    Returns:
        ``(error, queried)``. ``error`` is None when ``fn`` returned: its writes
        stay in the group's transaction. It is ``fn``'s exception when it
        raised or left the transaction marked for rollback: its writes are
        rolled back and the ``on_commit`` callbacks it registered dropped, as
        ``atomic()`` does. ``queried``: ``fn`` sent a query on ``connection``.

    Raises:
        django.db.DatabaseError: rolling back to the savepoint failed (the
            connection broke); the group's transaction is lost.
    """
    callbacks = len(connection.run_on_commit)
    sid = None

    def before_query(execute, sql, params, many, context):
        nonlocal sid
        if sid is None:
            sid = ""  # the SAVEPOINT statement itself passes through here
            sid = connection.savepoint()
        return execute(sql, params, many, context)

    try:
        with connection.execute_wrapper(before_query):
            fn()
        if connection.needs_rollback:
            raise DeliveryError(
                "the handler left the transaction marked for rollback (a database "
                "error caught inside atomic(), or transaction.set_rollback(True))"
            )
        if sid:
            connection.savepoint_commit(sid)
        return None, sid is not None
    except Exception as exc:
        error = exc
    # As atomic() leaves a failed nested block: clear the flag, roll back to the
    # savepoint; if that fails, the group's transaction is lost.
    connection.needs_rollback = False
    if sid:
        try:
            connection.savepoint_rollback(sid)
            connection.savepoint_commit(sid)
        except Exception:
            connection.needs_rollback = True
            raise
    del connection.run_on_commit[callbacks:]
    return error, sid is not None


class _Timer:
    fired = False


@contextmanager
def _time_limit(seconds: float | None) -> Iterator[_Timer]:
    """Interrupt the block with HandlerTimeout after ``seconds`` (SIGALRM; only
    in the main thread, the relay command's; elsewhere the lease bounds it).
    ``timer.fired`` tells afterwards whether it went off, even if the block
    caught the exception."""
    timer = _Timer()
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield timer
        return

    def interrupt(signum, frame):
        timer.fired = True
        raise HandlerTimeout(f"handler ran longer than its timeout of {seconds}s")

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield timer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
