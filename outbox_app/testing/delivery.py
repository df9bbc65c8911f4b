"""``deliver_now()``: the in-process handlers of captured events, run now, in
the test, as the relay runs them.

Each delivery takes the relay's handler path: one
:class:`~outbox_app.execution.run.Execution` with the relay's handler role
(the call in a savepoint of its own, its ``timeout``, span and metrics,
a transaction it leaves broken counted as a failure), in a transaction on
the event's database (a savepoint inside a ``TestCase``), its ``on_commit``
callbacks that are not ``robust`` run after it, each guarded (one that raises
fails the attempt), and every failed attempt judged by the handler's
:class:`~outbox_app.execution.retry.RetryPolicy` (``max_attempts``,
``retry_on``, ``give_up_on``).

Two things differ from a relay, on purpose. Time: a failed attempt that the
policy retries is retried at once, not after its backoff. Storage: nothing
is read from or written to the delivery tables; the captured events are the
input and the :class:`DeliveryReport` the output, so a relay run later
would still deliver the events (do not mix the two in one test).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from django.db import connections, transaction

from ..exceptions import EndlessDelivery, HandlerFailed
from ..store.lifecycle import State
from ..subscribers import DeliveryContext, Handler

if TYPE_CHECKING:
    from .recording import CapturedEvent, Recording

logger = logging.getLogger("outbox_app.testing")

#: Rounds of one deliver_now() call (each delivers what the previous one's
#: handlers published) before it gives up with EndlessDelivery.
MAX_ROUNDS = 100


@dataclass(frozen=True)
class DeliveryOutcome:
    """What ``deliver_now()`` did with one event for one handler.

    Attributes:
        captured: the event (:class:`~outbox_app.testing.CapturedEvent`).
        handler: the handler's name.
        state: ``"SUCCEEDED"``; ``"DEAD"`` (the dead letter: its last attempt
            failed, or an error it never retries); ``"SKIPPED"`` (its
            ``expires_at`` had passed: no attempt); ``"PENDING"`` (not due:
            scheduled later than now, or held back behind an undelivered
            earlier event of its aggregate, for an ``ordered`` handler;
            a later ``deliver_now()`` takes it up again).
        attempts: the attempts made.
        errors: each failed attempt's exception, in order (a SUCCEEDED
            delivery may have some: attempts the policy retried).
        reason: why it was SKIPPED or left PENDING.
    """

    captured: CapturedEvent
    handler: str
    state: str
    attempts: int = 0
    errors: tuple[BaseException, ...] = ()
    reason: str = ""

    @property
    def error(self) -> BaseException | None:
        """The last failed attempt's exception, or None."""
        return self.errors[-1] if self.errors else None

    def describe(self) -> str:
        """One line: handler, event, state, attempts and the last error."""
        captured = self.captured
        line = f"{self.handler}: {captured.event_type} {captured.id}: {self.state}"
        if self.attempts:
            line += f" after {self.attempts} attempt(s)"
        if self.error is not None:
            line += f": {type(self.error).__name__}: {self.error}"
        if self.reason:
            line += f" ({self.reason})"
        return line


@dataclass
class DeliveryReport:
    """What one ``deliver_now()`` call did, one :class:`DeliveryOutcome` per
    event and handler, in the order they ran (an event's handlers in
    registration order; events in publish order, round by round)."""

    outcomes: list[DeliveryOutcome] = field(default_factory=list)

    def _in(self, state: str) -> list[DeliveryOutcome]:
        return [o for o in self.outcomes if o.state == state]

    @property
    def succeeded(self) -> list[DeliveryOutcome]:
        return self._in(State.SUCCEEDED)

    @property
    def dead(self) -> list[DeliveryOutcome]:
        return self._in(State.DEAD)

    @property
    def skipped(self) -> list[DeliveryOutcome]:
        return self._in(State.SKIPPED)

    @property
    def pending(self) -> list[DeliveryOutcome]:
        return self._in(State.PENDING)

    @property
    def failures(self) -> list[tuple[DeliveryOutcome, BaseException]]:
        """Every failed attempt, retried or not: ``(outcome, exception)``."""
        return [(o, error) for o in self.outcomes for error in o.errors]

    def __str__(self) -> str:
        if not self.outcomes:
            return "nothing to deliver"
        return "\n".join(o.describe() for o in self.outcomes)


def deliver_now(
    captured: Recording,
    *,
    at: datetime.datetime | None = None,
    raise_errors: bool = True,
) -> DeliveryReport:
    """Run the registered in-process handlers of every captured event that
    stays (not rolled back) and has not been delivered by an earlier call,
    in publish order, as the relay runs them (module docstring); then the
    handlers of the events those handlers published, round by round, until
    none is left.

    As the relay: an event whose ``expires_at`` passed is SKIPPED; one
    scheduled after ``at`` stays PENDING; an ``ordered`` handler's events
    wait behind an earlier event of the same aggregate that is DEAD or
    PENDING. Broker publishers are not run: they are the relay's (see
    :func:`~outbox_app.testing.record_publishers`).

    Args:
        captured: the capture whose events are delivered.
        at: the time due and expiry are judged by (aware datetime); default
            the database's clock, as the relay's.
        raise_errors: True (the default): raise :class:`HandlerFailed` when
            a delivery ends DEAD. False: return the report all the same.

    Returns:
        The :class:`DeliveryReport` of this call.

    Raises:
        HandlerFailed: with ``raise_errors``, a delivery went to the dead
            letter; the message lists them, ``report`` holds the report, and
            the first one's exception is its ``__cause__``.
        EndlessDelivery: handlers still published new events after
            :data:`MAX_ROUNDS` rounds (a handler that publishes what it
            handles, say).
        django.db.DatabaseError: the database failed outside a handler (a
            handler's own errors are its delivery's failures).
    """
    from ..relay.registry import handlers

    report = DeliveryReport()
    held: set[tuple[str, str, str, str]] = set()
    clocks: dict[str, datetime.datetime] = {}
    with captured.listening():  # what the handlers publish is captured too
        start, rounds = 0, 0
        while True:
            end = captured.written()
            if rounds and start >= end:
                break
            if rounds == MAX_ROUNDS:
                raise EndlessDelivery(
                    f"deliver_now(): handlers still published new events after "
                    f"{MAX_ROUNDS} rounds (each delivers what the previous one "
                    f"published); the last round's were: "
                    + "; ".join(c.describe() for c in captured.resolve(start, end))
                )
            rounds += 1
            registered = handlers()
            for event in captured.resolve(start, end):
                if event.rolled_back:
                    continue
                alias = event.using
                if alias not in clocks:
                    clocks[alias] = at or _database_now(alias)
                for handler in registered:
                    if handler.receives(event.event_type):
                        outcome = _delivery(
                            captured, event, handler, clocks[alias], held
                        )
                        if outcome is not None:
                            report.outcomes.append(outcome)
            start = end
    dead = report.dead
    if raise_errors and dead:
        raise HandlerFailed(
            f"deliver_now(): {len(dead)} of {len(report.outcomes)} deliveries "
            "went to the dead letter:\n"
            + "\n".join(f"  {o.describe()}" for o in dead)
            + "\n(deliver_now(raise_errors=False) returns the report instead)",
            report,
        ) from dead[0].error
    return report


def _database_now(alias: str) -> datetime.datetime:
    from ..store.clock import database_now

    return database_now(alias)


def _delivery(
    captured: Recording,
    event: CapturedEvent,
    handler: Handler,
    now: datetime.datetime,
    held: set[tuple[str, str, str, str]],
) -> DeliveryOutcome | None:
    """Deliver ``event`` to ``handler`` unless it is finished, held back,
    expired or not due; record its state in ``captured._finished``. None: it
    was finished by an earlier call (nothing to report)."""
    row = event.row
    key = (event.using, event.id, handler.name)
    aggregate = None
    if handler.ordered and row.aggregate_id is not None:
        aggregate = (handler.name, event.using, row.aggregate_type, row.aggregate_id)
    state = captured._finished.get(key)
    if state is not None:
        if state == State.DEAD and aggregate is not None:
            held.add(aggregate)
        return None
    if aggregate in held:
        return DeliveryOutcome(
            event,
            handler.name,
            State.PENDING,
            reason="held back behind an earlier event of its aggregate",
        )
    if row.expires_at is not None and row.expires_at <= now:
        captured._finished[key] = State.SKIPPED
        return DeliveryOutcome(
            event,
            handler.name,
            State.SKIPPED,
            reason=f"its expires_at {row.expires_at.isoformat()} passed",
        )
    if row.deliver_at is not None and row.deliver_at > now:
        if aggregate is not None:
            held.add(aggregate)
        return DeliveryOutcome(
            event,
            handler.name,
            State.PENDING,
            reason=f"scheduled for {row.deliver_at.isoformat()}",
        )
    outcome = _attempts(event, handler, now)
    captured._finished[key] = outcome.state
    if outcome.state == State.DEAD and aggregate is not None:
        held.add(aggregate)
    return outcome


def _attempts(
    event: CapturedEvent, handler: Handler, now: datetime.datetime
) -> DeliveryOutcome:
    """Attempt ``handler`` on ``event`` until it succeeds or its retry
    policy gives up (no wait between attempts)."""
    from ..execution.retry import RetryPolicy

    policy = RetryPolicy.of(handler)
    errors: list[BaseException] = []
    attempt = 0
    while True:
        attempt += 1
        context = dataclasses.replace(
            event.context, attempt=attempt, subscriber=handler.name
        )
        error = _attempt(handler, context)
        if error is None:
            return DeliveryOutcome(
                event, handler.name, State.SUCCEEDED, attempt, tuple(errors)
            )
        errors.append(error)
        retry = policy.retry_at(error, attempt, now) is not None
        logger.warning(
            "deliver_now(): %s: event %s %s (attempt %d): %s",
            handler.name,
            context.event_id,
            "failed, retried now" if retry else "DEAD",
            attempt,
            error,
            extra={"subscriber": handler.name, "event_id": str(context.event_id)},
        )
        if not retry:
            return DeliveryOutcome(
                event, handler.name, State.DEAD, attempt, tuple(errors)
            )


def _attempt(handler: Handler, context: DeliveryContext) -> BaseException | None:
    """One call of ``handler``, as the relay makes it: its savepoint in a
    transaction on the event's database, then its ``on_commit`` callbacks
    that are not robust, each guarded. Returns the attempt's error, or
    None."""
    from ..execution.run import Execution, run_callbacks
    from ..relay.handlers import HANDLER

    connection = connections[context.using]
    with transaction.atomic(using=context.using):
        execution = Execution(HANDLER, handler, connection, take_callbacks=True)
        with execution.installed():
            error, _, callbacks = execution.run(context)
    if error is None and callbacks:
        error = run_callbacks(
            callbacks,
            owner=handler.name,
            row=f"event {context.event_id}",
            logger=logger,
            extra={"subscriber": handler.name},
        )
    return error
