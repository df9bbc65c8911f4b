"""The long-running relay: the loop around :func:`outbox_app.relay.relay_once`.

It adds what a process needs and the relay functions do not: wake-ups within
milliseconds of a commit (PostgreSQL LISTEN/NOTIFY; the in-process on-commit
signal everywhere), adaptive polling (at once while there is work, backing off
to ``OUTBOX_POLL_INTERVAL_SECONDS`` when idle), a clean stop on SIGTERM/SIGINT,
and survival of database outages (log, back off, reconnect). ``python manage.py
relay`` is a thin caller.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from django.db import Error as DatabaseError
from django.db import connections

from ..conf import outbox_settings
from ..exceptions import RelayAlreadyRunning
from ..execution.retry import RECONNECT
from ..health import HealthFile
from ..publishing.outbox import events_committed
from ..store.sql import dialect
from . import RelayReport, relay_once
from .loop import SubscriptionView
from .registry import Kind, close_publishers, subscribers
from .sending import pauses
from .wake import Listener

logger = logging.getLogger("outbox_app.relay.worker")

#: Shortest idle wait, in seconds: the first poll after work dried up.
MIN_POLL_SECONDS = 0.05
#: Longest time one iteration delivers before the loop checks its limits again.
ITERATION_SECONDS = 5.0


class RelayWorker:
    """Run the relay until stopped.

    Args:
        kind: ``"handler"``, ``"publisher"`` or ``None`` (both).
        using: database alias.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.
        max_seconds: stop after this many seconds; ``None`` runs until stopped.
        once: drain what is due now, then return.
        on_iteration: called with each iteration's RelayReport (progress output).
        poll_interval: longest idle wait in seconds; default
            ``OUTBOX_POLL_INTERVAL_SECONDS``.
        health: the health file to rewrite each loop turn
            (:mod:`outbox_app.health`): ready when the last turn reached the
            database and no publisher is paused; removed when the loop ends.

    Raises (from :meth:`run`):
        RelayAlreadyRunning: a second relay on one SQLite database file.
    """

    def __init__(
        self,
        *,
        kind: Kind | None = None,
        using: str = "default",
        batch_size: int | None = None,
        max_seconds: float | None = None,
        once: bool = False,
        on_iteration: Callable[[RelayReport], None] | None = None,
        poll_interval: float | None = None,
        health: HealthFile | None = None,
    ):
        self.kind = kind
        self.using = using
        self.batch_size = batch_size or outbox_settings.BATCH_SIZE
        self.max_seconds = max_seconds
        self.once = once
        self.on_iteration = on_iteration
        self.poll_interval = poll_interval or outbox_settings.POLL_INTERVAL_SECONDS
        self.health = health
        self.stopping = threading.Event()
        self._listen_failed = False
        self._listener: Listener | None = None

    def stop(self, *args: object) -> None:
        """Ask the loop to stop after the current batch (a signal handler).

        The events are set from a helper thread: a signal handler runs in the
        main thread, which may be inside ``Event.wait()`` holding the lock that
        ``Event.set()`` needs.
        """
        threading.Thread(target=self._stop, name="outbox-relay-stop").start()

    def _stop(self) -> None:
        if not self.stopping.is_set():
            logger.info("relay stopping: finishing the current batch")
        self.stopping.set()
        if self._listener is not None:
            self._listener.wake()

    def run(self) -> RelayReport:
        """Loop until stopped, out of time, or (``once``) drained.

        Returns:
            The RelayReport summed over the run.
        """
        total = RelayReport()
        deadline = (
            None if self.max_seconds is None else time.monotonic() + self.max_seconds
        )
        failures = 0
        idle_wait = MIN_POLL_SECONDS
        with single_relay_guard(self.using), Listener(self.using) as listener:
            self._listener = listener
            events_committed.connect(listener.wake, weak=False)
            logger.info(
                "relay started database=%s only=%s batch_size=%d wake=%s "
                "subscribers=%s",
                self.using,
                self.kind or "all",
                self.batch_size,
                "listen/notify" if listener.listens else "on-commit+poll",
                ",".join(f"{s.name}({s.kind})" for s in subscribers(self.kind))
                or "none",
            )
            backlog = _Backlog()
            # Paused subscribers and subscribed types, read at most once a
            # second across iterations, not at each wake-up.
            view = SubscriptionView(self.using)
            try:
                while not self.stopping.is_set():
                    began = time.monotonic()
                    budget = ITERATION_SECONDS
                    if deadline is not None:
                        budget = min(budget, deadline - time.monotonic())
                        if budget <= 0:
                            break
                    try:
                        report = relay_once(
                            kind=self.kind,
                            using=self.using,
                            batch_size=self.batch_size,
                            max_seconds=None if self.once else budget,
                            stop=self.stopping,
                            view=view,
                        )
                    except DatabaseError as exc:
                        failures += 1
                        self._recover(listener, exc, failures)
                        continue
                    failures = 0
                    self._report_health()
                    total += report
                    if self.on_iteration is not None:
                        self.on_iteration(report)
                    backlog.record(report, began)
                    if report.claimed or report.fanned_out:
                        logger.debug("relay iteration %s", report.fields())
                        idle_wait = MIN_POLL_SECONDS
                        # An iteration that ended before its budget found
                        # nothing more to do. Where the relay LISTENs, a commit
                        # made meanwhile has sent a NOTIFY that ends the wait at
                        # once, so it waits instead of passing again to find
                        # nothing; a poll must look.
                        drained = time.monotonic() - began < budget
                        if not self.once and not (drained and listener.listens):
                            continue
                    if self.once:
                        break
                    self._keep_connection()
                    idle_wait = self._idle(listener, idle_wait, deadline)
            finally:
                # Its cursors handed back: another relay goes on at once, not
                # a lease later (a deploy's SIGTERM, --once done).
                try:
                    view.close()
                except DatabaseError as exc:
                    logger.warning("relay could not hand its cursors back: %s", exc)
                if self.health is not None:
                    self.health.remove()
                events_committed.disconnect(listener.wake)
                close_publishers()
                # The connection it kept open across iterations (a worker run
                # in a thread of a longer-lived process leaves none behind).
                if not connections[self.using].in_atomic_block:
                    connections[self.using].close()
        logger.info("relay stopped %s", total.fields())
        return total

    def _report_health(self) -> None:
        """Rewrite the health file after a turn that reached the database:
        ready unless a publisher is paused (this process's pauses, no query)."""
        if self.health is None:
            return
        paused = pauses.reasons().items()
        why = "; ".join(f"publisher {name} paused: {text}" for name, text in paused)
        self.health.report(not paused, why)

    def _keep_connection(self) -> None:
        """Keep the database connection open between iterations, whatever
        ``CONN_MAX_AGE`` says (Django's default, 0, would close it at every
        idle wait and make each wake-up pay a new connection, ~5 ms on
        PostgreSQL); replace it only once it broke."""
        connection = connections[self.using]
        if connection.connection is not None and connection.errors_occurred:
            if not connection.is_usable():
                connection.close()
            connection.errors_occurred = False
        for alias in connections:  # other databases a handler used
            if alias != self.using:
                connections[alias].close_if_unusable_or_obsolete()

    def _idle(self, listener: Listener, wait: float, deadline: float | None) -> float:
        """Wait for a wake-up or the poll interval; return the next wait."""
        if deadline is not None:
            wait = max(0.0, min(wait, deadline - time.monotonic()))
        try:
            listener.open()  # reconnects a LISTEN connection that broke
        except Exception as exc:
            # Once per streak: it polls meanwhile and retries at each wait.
            if not self._listen_failed:
                logger.warning("relay cannot LISTEN, polling instead: %s", exc)
            self._listen_failed = True
            self.stopping.wait(wait)
            return min(wait * 2, self.poll_interval)
        self._listen_failed = False
        try:
            reason = listener.wait(wait)
        except Exception as exc:
            # The LISTEN connection broke: reopened at the next wait. A
            # database outage is told once, by the next iteration's error.
            logger.debug("relay wake-up listener lost, polling: %s", exc)
            self.stopping.wait(wait)
            reason = None
        if reason:
            logger.debug("relay woken wake=%s", reason)
            return MIN_POLL_SECONDS
        return min(wait * 2, self.poll_interval)

    def _recover(self, listener: Listener, exc: Exception, failures: int) -> None:
        delay = RECONNECT.delay(failures)
        logger.error(
            "relay database error (attempt %d), reconnecting in %.1fs: %s",
            failures,
            delay,
            exc,
        )
        connections[self.using].close()
        listener.close()
        if self.health is None:
            self.stopping.wait(delay)
            return
        self.health.report(False, f"database unreachable: {exc}")
        self.health.wait(self.stopping, delay)


class _Backlog:
    """Logs when the relay finds work after idling and when it has drained
    it (INFO, the relay command's default verbosity): a long-running relay
    says what it is doing without a line per batch."""

    def __init__(self) -> None:
        self.since: float | None = None
        self.done = RelayReport()

    def record(self, report: RelayReport, began: float) -> None:
        """Count one iteration's ``report``; ``began``: when it started
        (``time.monotonic()``), the start of a backlog it finds."""
        busy = bool(report.claimed or report.fanned_out)
        if busy and self.since is None:
            self.since, self.done = began, RelayReport()
            logger.info("relay busy: events to deliver")
        if self.since is None:
            return
        self.done += report
        if not busy:
            logger.info(
                "relay idle: backlog drained in %.1f s, %s",
                time.monotonic() - self.since,
                self.done.fields(),
            )
            self.since = None


@contextmanager
def single_relay_guard(alias: str) -> Iterator[None]:
    """Hold an exclusive lock for the life of a relay on a SQLite database.

    Elsewhere it does nothing: skip-locked claims let relays run side by side.
    The lock is an ``flock`` on ``<database file>.relay.lock``, released by the
    kernel when the process exits, even on SIGKILL.

    Raises:
        RelayAlreadyRunning: another process holds the lock for this file.
    """
    if not dialect(alias).single_writer:
        yield
        return
    name = str(connections[alias].settings_dict["NAME"])
    if name == ":memory:" or name.startswith("file:"):
        yield
        return
    path = f"{name}.relay.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RelayAlreadyRunning(
                f"Another relay is already running on the SQLite database {name}. "
                "SQLite supports one relay process per database file; stop the "
                "other one, or use PostgreSQL or MySQL/MariaDB to run several."
            ) from None
        yield
    finally:
        os.close(fd)
