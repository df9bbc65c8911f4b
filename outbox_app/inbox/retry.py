"""The retries of failed messages, from the database.

A consumer that raised left its message in the inbox row, FAILED and due
again after the relay's backoff (:mod:`~outbox_app.inbox.outcomes`,
``record_failure``); :func:`retry_due` runs those that are due, as on
receipt, until they are handled or DEAD (the dead letter) after their
attempts. Retrying from the database rather than by broker redelivery: a
failing message is acknowledged and never blocks the queue nor spins in a
redelivery loop, the attempts are counted whatever the broker (classic
RabbitMQ queues and Redis count none), and the dead letter is in the same
place as the relay's, requeueable from the admin.
"""

from __future__ import annotations

import datetime
import functools
import operator
from collections.abc import Sequence

from django.db import router, transaction
from django.db.models import Exists, OuterRef, Q

from ..events.cloudevents import parse
from ..store.clock import database_now
from ..store.lifecycle import InboxState
from ..store.models import InboxMessage
from .context import context_for, published_at
from .outcomes import Ran, Tally, after_commit, record_failure
from .receive import UNFINISHED, run_consumer
from .registry import Consumer


def retry_due(
    consumers: Sequence[Consumer],
    *,
    limit: int = 100,
    now: datetime.datetime | None = None,
    using: str | None = None,
) -> Tally:
    """Run the FAILED messages of ``consumers`` that are due again, oldest due
    first, each in its own transaction holding its row's lock (another
    ``consume`` process skips it), then its ``on_commit`` callbacks; at most
    ``limit``. A consumer takes only the messages of types it receives (a
    message kept for another version of it waits for that version). An
    ordered consumer's message waits while an earlier one of its aggregate is
    FAILED or DEAD.

    Args:
        consumers: this process's consumers.
        limit: messages run at most.
        now: the clock (tests pass one); default the database's, read
            before each message.
        using: database alias; default the router's for InboxMessage.

    Returns:
        What happened (``handled``, ``failed``, ``dead``).

    Raises:
        django.db.DatabaseError: the database failed; what it had run
            before stays committed.
    """
    alias = using or router.db_for_write(InboxMessage)
    by_name = {c.name: c for c in consumers}
    tally = Tally()
    if not by_name:
        return tally
    runnable = _runnable(list(by_name.values()))
    for _ in range(limit):
        moment = now or database_now(alias)
        ran: list[Ran] = []
        # The row stays locked until its outcome is written: no other consume
        # process runs it meanwhile.
        with transaction.atomic(using=alias):
            row = _next_due(runnable, moment, alias)
            if row is None:
                return tally
            tally += _retry(by_name[row.consumer], row, alias, ran)
        tally += after_commit(ran, alias)
    return tally


def _runnable(consumers: Sequence[Consumer]) -> Q:
    """The inbox rows ``consumers`` may run now: each one's own, of the
    types it receives (and an undecodable message requeued for it, which is
    dead-lettered again), and for an ordered one none behind an earlier
    message of its aggregate that is FAILED or DEAD."""
    theirs = functools.reduce(
        operator.or_,
        (
            Q(consumer=c.name)
            if c.event_types is None
            # "": an undecodable message, requeued: it is dead-lettered again.
            else Q(consumer=c.name, event_type__in=sorted({*c.event_types, ""}))
            for c in consumers
        ),
    )
    earlier = InboxMessage.objects.filter(
        consumer=OuterRef("consumer"),
        aggregate_type=OuterRef("aggregate_type"),
        aggregate_id=OuterRef("aggregate_id"),
        state__in=UNFINISHED,
        id__lt=OuterRef("id"),
    )
    ordered = [c.name for c in consumers if c.ordered]
    return theirs & (~Q(consumer__in=ordered) | Q(aggregate_id="") | ~Exists(earlier))


def _next_due(runnable: Q, now: datetime.datetime, alias: str) -> InboxMessage | None:
    """The FAILED row of ``runnable`` due first at ``now``, locked for the
    caller's transaction (a row another process holds is skipped), or
    None."""
    due = (
        InboxMessage.objects.using(alias)
        .filter(runnable, state=InboxState.FAILED, next_retry_at__lte=now)
        .order_by("next_retry_at", "id")
    )
    return due.select_for_update(skip_locked=True).first()


def _retry(consumer: Consumer, row: InboxMessage, alias: str, ran: list[Ran]) -> Tally:
    """Run ``row``'s message for ``consumer`` again, in a savepoint (a
    failure undoes the consumer's writes only), and write its outcome:
    HANDLED, the run going to ``ran`` for its ``on_commit`` callbacks, or the
    failed attempt (FAILED again, or DEAD)."""
    attempt, body = row.attempts + 1, row.body
    try:
        with transaction.atomic(using=alias):
            context = context_for(parse(body), consumer, row.queue, attempt)
            callbacks = run_consumer(consumer, context, alias)
    except Exception as exc:
        return record_failure(
            consumer, row, body, exc, alias, attempt=attempt, insert=False
        )
    row.state, row.attempts = InboxState.HANDLED, attempt
    row.handled_at = row.updated_at = database_now(alias)
    row.next_retry_at, row.body = None, ""
    row.save(using=alias)
    ran.append(Ran(consumer, row, body, callbacks, published_at(context)))
    return Tally(handled=1)
