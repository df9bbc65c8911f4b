"""Running in-process handlers over a claimed batch.

Handlers run in groups: one transaction per group, each handler in a
savepoint, then one compare-and-set UPDATE marks the group's successful rows
SUCCEEDED. A handler's database writes and its mark commit together, so a
handler that only touches the database takes effect exactly once; a failing
handler's savepoint is rolled back and its failure recorded after the group
commits; if any row of the group lost its lease meanwhile, the whole group
rolls back. A group closes after a handler that queried the database (so its
locks are released with it, as if it ran alone) or after
``OUTBOX_HANDLER_GROUP_SECONDS`` (a tenth of the lease, if less): handlers
that do not touch the database share one commit, the others get one each.

A handler that registers ``transaction.on_commit`` callbacks (one not
``robust``, at least) is not marked in the group's transaction: its callbacks
are taken out of Django's list before the commit (its row is fenced by its
lease in that transaction like the others), run by the relay after it, each
guarded, and then the rows of such handlers are marked SUCCEEDED (one UPDATE
per group), or failed with the error of a callback that raised. So a raising
callback fails only its own row and never the commit, the other handlers'
callbacks or the process; such a handler is at least once (a crash between
the commit and the mark runs it again, its writes already committed).

Before each group the batch keeps its lease (:meth:`Batch.keep`): rows another
relay took over are dropped, and a relay that may have lost its lease renews
before it starts another handler, so a relay back from a stall never runs
handlers over rows it no longer holds.

A handler's ``timeout`` is a SIGALRM in the main thread (the relay
command's); it never interrupts a database call, which would leave the
connection unusable: an alarm that falls inside one takes effect as soon as the
call returns.
"""

from __future__ import annotations

import logging
import random
import threading
import time

from django.db import connections, transaction

from ..conf import outbox_settings
from ..exceptions import LeaseLost
from ..execution.metrics import relay_metrics
from ..execution.retry import RetryPolicy
from ..execution.run import Callback, Execution, Role, run_callbacks
from ..subscribers import DeliveryContext, Handler
from .batch import Batch
from .outcomes import Outcomes
from .stream import StreamBatch

logger = logging.getLogger("outbox_app.relay")


def _span(handler: Handler, context: DeliveryContext) -> tuple[str, dict]:
    """A handler call's span: ``outbox handle <event type>``, named by the
    handler and the event id."""
    return f"outbox handle {context.event_type}", {
        "messaging.system": "outbox_app",
        "messaging.operation.type": "process",
        "messaging.destination.name": handler.name,
        "messaging.message.id": str(context.event_id),
        "outbox.attempt": context.attempt,
    }


#: Handlers run in a savepoint each, inside their group's transaction.
HANDLER = Role("handler", savepoint=True, span=_span, metrics=relay_metrics)


def run_handlers(
    batch: Batch | StreamBatch,
    handler: Handler,
    outcomes: Outcomes,
    stop: threading.Event,
    rng: random.Random | None = None,
) -> None:
    """Run ``handler`` on the batch's events, in order, group by group, and
    record every outcome through the batch's settlement (rows: a
    compare-and-set per row; a stream batch: its rows and the cursor's move,
    in the group's transaction). When ``stop`` is set, the events not
    attempted yet are left (rows: released; a stream: the cursor stays
    before them)."""
    _Runner(batch, handler, outcomes, stop, rng).run()


class _Runner:
    def __init__(self, batch, handler, outcomes, stop, rng):
        self.batch: Batch | StreamBatch = batch
        self.handler: Handler = handler
        self.outcomes: Outcomes = outcomes
        self.settle = batch.settlement(outcomes)
        self.stop: threading.Event = stop
        self.rng = rng
        self.policy = RetryPolicy.of(handler)
        self.using = batch.gateway.using
        self.seconds = min(
            outbox_settings.HANDLER_GROUP_SECONDS, outbox_settings.LEASE_SECONDS / 10
        )

    def run(self) -> None:
        waiting = list(self.batch.contexts)
        while waiting:
            if self.stop.is_set():
                self.settle.stopped(waiting)
                return
            kept = self.batch.keep(waiting)
            self.outcomes.lost(len(waiting) - len(kept), "were taken over")
            if not kept:
                return
            waiting = kept[self._group(kept) :]
        self.settle.finish()

    def _group(self, contexts: list[DeliveryContext]) -> int:
        """Run handlers on a prefix of ``contexts`` in one transaction, for
        about ``self.seconds``; record the outcomes. Returns how many events
        it took."""
        succeeded: list[DeliveryContext] = []
        failures: list[tuple] = []
        # The handlers whose on_commit callbacks the relay runs after the
        # commit, with those callbacks: they are marked once these ran.
        deferred: list[tuple[DeliveryContext, list[Callback]]] = []
        taken = 0
        connection = connections[self.using]
        # Inside a caller's transaction (a test case, relay_once() in an
        # atomic block) the callbacks belong to that transaction's commit.
        outermost = not connection.in_atomic_block
        written: list = []
        try:
            with transaction.atomic(using=self.using):
                callbacks = len(connection.run_on_commit)
                execution = Execution(
                    HANDLER, self.handler, connection, take_callbacks=outermost
                )
                deadline = time.monotonic() + self.seconds
                with execution.installed():
                    for context in contexts:
                        if taken and (
                            time.monotonic() >= deadline
                            or self.stop.is_set()
                            or self.batch.lease_may_have_run_out()
                        ):
                            break
                        taken += 1
                        if self.settle.skip(context):
                            continue
                        error = self.policy.lease_ran_out(context.attempt)
                        queried, later = False, None
                        if error is None:
                            error, queried, later = execution.run(context)
                        if later:
                            deferred.append((context, later))
                            self.settle.hold(context)
                        elif error is None:
                            succeeded.append(context)
                        else:
                            failures.append(
                                (context, error, self._retry_at(context, error))
                            )
                            self.settle.hold(context)
                        if queried:
                            # Its locks are held until the commit: commit now,
                            # so no lock outlives its handler (two workers'
                            # groups would otherwise deadlock on an
                            # application's hot rows).
                            break
                in_transaction = execution.queried or bool(
                    connection.run_on_commit[callbacks:]
                )
                end = taken == len(contexts)
                if in_transaction:
                    # The group's outcome, in its transaction (with the
                    # handlers' writes, before their on_commit callbacks),
                    # fenced by the lease: if it passed to another relay,
                    # LeaseLost rolls the group back.
                    written, later_contexts = self.settle.group(
                        succeeded,
                        failures,
                        [c for c, _ in deferred],
                        contexts[taken - 1],
                        inside=True,
                        fence_deferred=execution.queried,
                        end=end,
                    )
                    deferred = _renamed(deferred, later_contexts)
            if not in_transaction:
                # Nothing was sent in the group's transaction (on PostgreSQL
                # it did not even begin) and nothing waits for its commit:
                # the outcome goes alone.
                written, later_contexts = self.settle.group(
                    succeeded,
                    failures,
                    [c for c, _ in deferred],
                    contexts[taken - 1],
                    inside=False,
                    end=end,
                )
                deferred = _renamed(deferred, later_contexts)
        except LeaseLost:
            # A handler outran the lease and another relay took its rows (or
            # the cursor): every write of the group is rolled back (and the
            # callbacks taken out are dropped with them).
            self.settle.lost(succeeded + [c for c, _ in deferred])
            deferred, written = [], []
        except BaseException:
            # The group's transaction is gone (its connection broke, or the
            # process is being interrupted): its successes were rolled back.
            self.settle.abandoned(failures)
            raise
        self.settle.recorded(written)
        if deferred:
            self._after_commit(deferred)
        return taken

    def _retry_at(self, context: DeliveryContext, error: BaseException):
        return self.policy.retry_at(
            error, context.attempt, self.batch.clock(), self.rng
        )

    def _after_commit(
        self, deferred: list[tuple[DeliveryContext, list[Callback]]]
    ) -> None:
        """Run the ``on_commit`` callbacks of the handlers of ``deferred`` now
        that their writes committed, in order, each guarded
        (:func:`~outbox_app.execution.run.run_callbacks`), then record the
        outcomes: SUCCEEDED (one UPDATE for them all), or a failed attempt
        with the first error a handler's callback raised (retried, or
        DEAD, by the retry policy). A ``robust`` callback's error is
        logged, as Django logs it, and fails nothing. A crash before the marks
        leaves the rows RUNNING until their lease runs out: the handlers then
        run again, over their committed writes (at least once)."""
        done: list[DeliveryContext] = []
        failures: list[tuple[DeliveryContext, BaseException]] = []
        name = self.handler.name
        for context, callbacks in deferred:
            error = run_callbacks(
                callbacks,
                owner=name,
                row=f"delivery {context.delivery_id}",
                logger=logger,
                extra={"subscriber": name},
            )
            if error is None:
                done.append(context)
            else:
                failures.append((context, error))
        outcomes = self.settle.deferred_outcomes()
        outcomes.succeeded(done)
        for context, error in failures:
            outcomes.failed(context, error, self._retry_at(context, error))


def _renamed(
    deferred: list[tuple[DeliveryContext, list[Callback]]],
    contexts: list[DeliveryContext],
) -> list[tuple[DeliveryContext, list[Callback]]]:
    """``deferred`` with each context replaced by the one of the same event in
    ``contexts`` (its row written), those without one left out."""
    by_event = {c.event_id: c for c in contexts}
    return [
        (by_event[c.event_id], callbacks)
        for c, callbacks in deferred
        if c.event_id in by_event
    ]
