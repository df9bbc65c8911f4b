"""Time limits on user code: a handler's or a consumer's ``timeout``, a
SIGALRM in the main thread that never interrupts a database call (an alarm
that falls inside one takes effect once the call returns)."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..exceptions import CallTimeout


class Deferral:
    """An execute wrapper that counts the database calls in progress, so a
    time limit (:func:`time_limit`) that goes off during one is raised only
    once it returns: raising inside the driver leaves the connection
    mid-protocol ("another command is already in progress"), and the
    transaction with it.

    Args:
        what: who is timed, for the message ("handler", "consumer").
    """

    def __init__(self, what: str = "handler"):
        self.what = what
        self.timeout: float | None = None
        self.depth = 0  # database calls in progress (nested: a SAVEPOINT)
        self.deferred = False  # the time limit went off during one

    def __call__(self, execute, sql, params, many, context):
        self.depth += 1
        try:
            self.before()
            return execute(sql, params, many, context)
        finally:
            self.depth -= 1
            if self.deferred and not self.depth:
                self.deferred = False
                raise self.timed_out()

    def before(self) -> None:
        """Runs before each database call, inside the count."""

    def timed_out(self) -> CallTimeout:
        return CallTimeout(
            f"{self.what} ran longer than its timeout of {self.timeout}s"
        )


class _Timer:
    fired = False


@contextmanager
def time_limit(seconds: float | None, guard: Deferral) -> Iterator[_Timer]:
    """Interrupt the block with CallTimeout after ``seconds`` (SIGALRM; only
    in the main thread, the relay's and ``consume``'s; elsewhere no limit).

    An alarm that goes off inside a database call is deferred to the moment
    the call returns (``guard``, installed as the connection's execute
    wrapper). ``timer.fired`` tells afterwards whether it went off, even if
    the block caught the exception.
    """
    timer = _Timer()
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield timer
        return

    def interrupt(signum, frame):
        timer.fired = True
        if guard.depth:
            guard.deferred = True
            return
        raise guard.timed_out()

    guard.timeout = seconds
    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield timer
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        guard.deferred = False
