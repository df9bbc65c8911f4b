"""Running user code, a relay's handler or a ``consume`` process's consumer,
and what its failure leaves.

:class:`Execution` is the one wrapper around such a call: the event it
receives (:func:`event_for`), its transaction, its time limit
(:func:`~outbox_app.execution.limits.time_limit`), its span
(:func:`~outbox_app.execution.tracing.span`), its duration
(:class:`~outbox_app.execution.metrics.CallMetrics`) and the ``on_commit``
callbacks it registers, taken out of Django's list so that the caller runs
them after its commit (:func:`run_callbacks`), each guarded: a callback that
raises fails its own row only. A failure is kept on its row as
:func:`recorded_error` renders it. What differs between handlers and
consumers is a :class:`Role`.
"""

from __future__ import annotations

import logging
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..conf import outbox_settings
from ..events.codec import decode
from ..events.text import storable
from ..events.types import event_class
from ..exceptions import TransactionBroken
from ..store.db import transaction_broken
from ..subscribers import dotted_path
from . import tracing
from .limits import Deferral, time_limit
from .metrics import CallMetrics

#: ``(func, robust)``: an ``on_commit`` callback a call registered.
Callback = tuple[Callable[[], Any], bool]


def event_for(context: Any) -> Any:
    """The event a handler or a consumer receives for ``context`` (a
    DeliveryContext or a ConsumeContext): the Event instance, or the payload
    dict for a type no class defines.

    Raises:
        EventDecodeError: the payload no longer fits its class.
    """
    if event_class(context.event_type) is None:
        return context.payload
    return decode(context.event_type, context.revision, context.payload)


def recorded_error(error: BaseException) -> tuple[str, str, str]:
    """``(message, dotted type, traceback)`` of ``error`` as failed rows keep
    them (deliveries, inbox messages): the traceback's last
    ``OUTBOX_MAX_TRACEBACK_CHARS`` characters; each made storable
    (:func:`~outbox_app.events.text.storable`: a lone surrogate or a NUL character in
    an exception's text becomes a backslash escape). An exception whose
    ``str()`` raises is recorded by its type."""
    limit = outbox_settings.MAX_TRACEBACK_CHARS
    text = "".join(traceback.format_exception(error))
    try:
        message = str(error) or repr(error)
    except Exception:
        message = f"<{type(error).__name__}: str() raised>"
    return (
        storable(message),
        storable(dotted_path(type(error)))[:255],
        storable(text[-limit:] if limit else ""),
    )


@dataclass(frozen=True)
class Role:
    """What one kind of user code is to :class:`Execution`: where handlers
    and consumers differ.

    Attributes:
        what: its word in errors and logs (``"handler"``, ``"consumer"``):
            "handler ran longer than its timeout of 2s".
        savepoint: True: each call runs in a savepoint of its own, sent
            before its first query, inside a transaction that the caller
            shares among many calls (a handler group); a failed call is rolled
            back to it and the transaction goes on. A call that never queries
            this database (an e-mail, a cache, an HTTP call) costs no round
            trip, which is most of what a no-op handler would cost otherwise.
            False: the caller's own atomic block holds the call (a consumer,
            with its inbox row) and is what rolls back: the caller raises the
            returned error through it.
        span: ``(callee, context) -> (name, attributes)`` of the call's span
            (kind CONSUMER); called only when a span would be recorded.
        metrics: where each call's duration goes
            (:meth:`~outbox_app.execution.metrics.CallMetrics.call`); the
            caller counts the rows' outcomes there, in its own words (the
            relay's: a delivery succeeded, failed, dead, ...; the inbox's: a
            message handled, failed, dead).
    """

    what: str
    savepoint: bool
    span: Callable[[Any, Any], tuple[str, Mapping[str, Any]]]
    metrics: CallMetrics


class Execution(Deferral):
    """Runs one handler's or consumer's calls on one database connection,
    one after another. It is the connection's execute wrapper while
    :meth:`installed`: it sends a handler's savepoint before the call's first
    query, and defers a time limit that goes off during a query until the
    query returns.

    Args:
        role: :class:`Role` of the callee.
        callee: a Handler or a Consumer: its ``name``, ``fn(event,
            context)`` and ``timeout`` (seconds, or None for no limit).
        connection: the Django connection the callee's writes go to.
        take_callbacks: take the ``on_commit`` callbacks a call registers out
            of Django's list for the caller to run after its commit
            (:func:`run_callbacks`). False inside a caller's transaction,
            whose commit runs them (Django's rule).
    """

    def __init__(self, role: Role, callee: Any, connection, *, take_callbacks: bool):
        super().__init__(role.what)
        self.role = role
        self.callee = callee
        self.connection = connection
        self.take_callbacks = take_callbacks
        self.sid: str | None = None  # the running call's savepoint ("": none)
        self.queried = False  # a call sent a query

    def installed(self):
        """A context manager: this execution is the connection's execute
        wrapper within it."""
        return self.connection.execute_wrapper(self)

    def before(self) -> None:
        if self.sid is None:
            self.sid = ""  # the SAVEPOINT statement itself passes here
            if self.role.savepoint:
                self.sid = self.connection.savepoint()
            self.queried = True

    def run(self, context: Any) -> tuple[Exception | None, bool, list[Callback] | None]:
        """Call the callee with ``context``'s event, within its time limit and
        span, in a savepoint (:attr:`Role.savepoint`).

        Returns:
            ``(error, queried, callbacks)``. ``error`` is None when the call
            returned and its transaction can commit; else the exception it
            raised, :class:`~outbox_app.exceptions.CallTimeout` when it ran
            past its ``timeout`` (even if it caught that and returned),
            :class:`~outbox_app.exceptions.TransactionBroken` when it returned
            but left its transaction unable to commit, or the event's decoding
            error. With a savepoint, a failed call's writes are rolled back
            and the ``on_commit`` callbacks it registered dropped, as
            ``atomic()`` does. ``queried``: the call sent a query.
            ``callbacks``: those it registered, taken out of Django's list,
            when ``take_callbacks`` and one of them is not ``robust``; else
            None (Django runs them at the commit and logs a robust one's
            error: ``publish()``'s wake-up is one).

        Raises:
            django.db.DatabaseError: rolling back to the savepoint failed (the
                connection broke); the caller's transaction is lost.
        """
        connection = self.connection
        registered = len(connection.run_on_commit)
        self.sid = None
        try:
            self._call(context)
            broken = transaction_broken(connection)
            if broken:
                raise TransactionBroken(f"the {self.what} {broken}")
            if self.sid:
                connection.savepoint_commit(self.sid)
        except Exception as exc:
            if self.role.savepoint:
                self._roll_back(registered)
            return exc, self.sid is not None, None
        callbacks = None
        if self.take_callbacks:
            callbacks = _take_callbacks(connection, registered)
        return None, self.sid is not None, callbacks

    def _call(self, context: Any) -> None:
        event = event_for(context)
        if not tracing.recording():
            self._timed(event, context)
            return
        name, attributes = self.role.span(self.callee, context)
        with tracing.span(
            name, producer=False, headers=(context.headers,), attributes=attributes
        ):
            self._timed(event, context)

    def _timed(self, event: Any, context: Any) -> None:
        callee = self.callee
        fired = False
        began = time.monotonic()
        try:
            if callee.timeout:
                with time_limit(callee.timeout, self) as timer:
                    callee.fn(event, context)
                fired = timer.fired
            else:
                callee.fn(event, context)
        finally:
            self.role.metrics.call(callee.name, time.monotonic() - began)
        if fired:  # it caught CallTimeout and returned
            raise self.timed_out()

    def _roll_back(self, registered: int) -> None:
        """As ``atomic()`` leaves a failed nested block: clear the flag, roll
        back to the savepoint (if it was sent), drop the callbacks registered
        since ``registered``. If the rollback fails, the transaction is lost."""
        connection = self.connection
        connection.needs_rollback = False
        if self.sid:
            try:
                connection.savepoint_rollback(self.sid)
                connection.savepoint_commit(self.sid)
            except Exception:
                connection.needs_rollback = True
                raise
        del connection.run_on_commit[registered:]


def _take_callbacks(connection, start: int) -> list[Callback] | None:
    """The ``on_commit`` callbacks registered on ``connection`` from position
    ``start`` on, taken out of Django's list, when one of them is not
    ``robust``; None (and left to Django) when there is none or all are
    robust: Django runs those at the commit and logs their errors, so they can
    neither fail the commit nor keep other callbacks from running."""
    added = connection.run_on_commit[start:]
    if all(robust for _, _, robust in added):
        return None
    del connection.run_on_commit[start:]
    return [(func, robust) for _, func, robust in added]


def run_callbacks(
    callbacks: list[Callback],
    *,
    owner: str,
    row: str,
    logger: logging.Logger,
    extra: Mapping[str, Any],
) -> Exception | None:
    """Run ``callbacks`` (as :meth:`Execution.run` took them, in the order
    they were registered) now that the transaction of the call that
    registered them committed, each guarded: every one runs whatever the
    others do.

    Args:
        owner, row: whose callbacks they are, for the log (``"billing"``,
            ``"delivery 12"``).
        logger, extra: where a logged error goes, with these structured
            fields.

    Returns:
        The exception the first callback not ``robust`` raised (its row's
        failure), or None. The others' (a robust one's, a later one's) are
        logged at ERROR with their traceback, as Django logs a robust
        callback's.
    """
    error = None
    for func, robust in callbacks:
        try:
            func()
        except Exception as exc:
            if robust or error is not None:
                logger.error(
                    "%s: an on_commit callback of %s raised: %s",
                    owner,
                    row,
                    exc,
                    exc_info=exc,
                    extra=extra,
                )
            else:
                error = exc
    return error
