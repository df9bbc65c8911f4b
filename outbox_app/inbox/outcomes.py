"""What the inbox writes for each outcome of a message, and counts: the
inbox row of a first run (:func:`first_row`), of a message kept for a
recorded consumer this process lacks (:func:`kept_row`, :func:`keep`), of a
failed attempt (:func:`record_failure`: FAILED, due again after the backoff,
or DEAD) and of an undecodable message (:func:`park_undecodable`); the
duplicates whose body differs from the first message of their id
(:func:`differing_bodies`, :func:`report_differing`); the ``on_commit``
callbacks of the runs that committed (:func:`after_commit`); and the counts
of all that (:class:`Tally`, :data:`consume_metrics`).

Every outside text stored passes through
:func:`~outbox_app.events.text.storable`.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import DatabaseError, IntegrityError, connections, transaction

from ..events.text import storable
from ..exceptions import UndecodableMessage
from ..execution.metrics import Counts, consume_metrics
from ..execution.retry import RetryPolicy
from ..execution.run import Callback, recorded_error, run_callbacks
from ..store.clock import database_now
from ..store.lifecycle import InboxState
from ..store.models import InboxMessage
from ..store.sql import dialect
from ..subscribers import dotted_path
from .registry import Consumer

logger = logging.getLogger("outbox_app.inbox")

#: The inbox's unique key: (consumer, source, message_id).
UNIQUE = "outbox_inbox_key"

#: Its columns, in that order.
KEY = ("consumer", "source", "message_id")

#: The error type an undecodable message's row records.
UNDECODABLE = dotted_path(UndecodableMessage)

#: The last error of a message an ordered consumer holds back.
HELD_BACK = "waiting behind an earlier message of its aggregate (ordered consumer)"


@dataclass
class Tally(Counts):
    """Counts of messages (per consumer they were meant for).

    Attributes:
        handled: consumers run and committed (retries included).
        duplicates: already in the inbox (handled, or kept to retry):
            acknowledged without running the consumer (one with another body
            than the first message of its id is logged and counted too).
        failed: the consumer raised; kept to retry.
        dead: the dead letter: out of attempts, or undecodable.
        waiting: held behind an earlier message of their aggregate.
        expired: arrived after their CloudEvents ``expiretime``
            (``publish(expires_at=...)``): acknowledged without running the
            consumer, no inbox row written.
        ignored: messages no consumer of their queue receives (neither this
            process's nor a recorded one).
        deferred: kept as the inbox row of a recorded consumer this process
            lacks (a rolling deploy: FAILED, due now, no attempt counted),
            run by a ``consume`` process that has it.
    """

    handled: int = 0
    duplicates: int = 0
    failed: int = 0
    dead: int = 0
    waiting: int = 0
    expired: int = 0
    ignored: int = 0
    deferred: int = 0


@dataclass
class Ran:
    """A consumer run whose transaction committed (or will, with the one it
    is in), and the ``on_commit`` callbacks taken out of Django's list that
    it registered there (None: none, or only ``robust`` ones, left to
    Django)."""

    consumer: Consumer
    row: InboxMessage
    body: bytes | str
    callbacks: list[Callback] | None = None
    #: When its event was published (its ``deliverat``, if later), for the
    #: latency metric; None when the message says not.
    since: datetime.datetime | None = None


def count_outcome(names: Sequence[str], outcome: str) -> None:
    """One message's ``outcome`` for each consumer of ``names``, in
    :data:`consume_metrics`."""
    for name in names:
        consume_metrics.outcome(name, outcome)


def first_row(
    name: str, columns: dict[str, str], queue: str, now, **values
) -> InboxMessage:
    """The HANDLED inbox row of a first run (the rollback takes it away if
    the consumer fails), or with ``values`` instead."""
    fields_ = {
        "state": InboxState.HANDLED,
        "attempts": 1,
        "handled_at": now,
        **values,
    }
    return InboxMessage(
        consumer=name,
        queue=storable(queue)[:255],
        received_at=now,
        updated_at=now,
        **columns,
        **fields_,
    )


def kept_row(name: str, columns, queue: str, body: bytes, now) -> InboxMessage:
    """The row of a message kept for ``name``, a recorded consumer this
    process lacks: FAILED, due now, no attempt counted, the body kept."""
    return first_row(
        name,
        columns,
        queue,
        now,
        state=InboxState.FAILED,
        attempts=0,
        handled_at=None,
        next_retry_at=now,
        body=storable(body),
        last_error=(
            f"kept for the consumer {name}: this consume process does not have "
            "it (another version of the code does); a process that has it runs it"
        ),
    )


def keep(row: InboxMessage, alias: str) -> Tally:
    """Insert ``row`` (:func:`kept_row`); a duplicate if it is there."""
    try:
        with transaction.atomic(using=alias):
            row.save(using=alias, force_insert=True)
    except IntegrityError as exc:
        if dialect(alias).violated_constraint(exc, InboxMessage) == UNIQUE:
            consume_metrics.outcome(row.consumer, "duplicate")
            report_differing(differing_bodies([row], alias))
            return Tally(duplicates=1)
        raise
    log_kept([row])
    consume_metrics.outcome(row.consumer, "deferred")
    return Tally(deferred=1)


def log_kept(rows: list[InboxMessage]) -> None:
    names = sorted({row.consumer for row in rows})
    if names:
        logger.warning(
            "%d message(s) kept for %s, which this consume process lacks "
            "(recorded by another one): a process that has it runs them",
            len(rows),
            ", ".join(names),
        )


def differing_bodies(
    duplicates: Sequence[InboxMessage], alias: str
) -> list[tuple[InboxMessage, str]]:
    """Which of ``duplicates`` (rows not inserted: their key is taken) came
    with another body than the message their key holds, each with that
    first message's digest. One query, only when there are duplicates; a
    row recorded before the inbox kept digests (an empty one) differs from
    nothing."""
    if not duplicates:
        return []
    first = dict(
        ((consumer, source, message_id), digest)
        for consumer, source, message_id, digest in InboxMessage.objects.using(alias)
        .filter(  # the unique key's columns: its index finds them
            consumer__in={row.consumer for row in duplicates},
            source__in={row.source for row in duplicates},
            message_id__in={row.message_id for row in duplicates},
        )
        .exclude(body_digest="")
        .values_list(*KEY, "body_digest")
    )
    found = []
    for row in duplicates:
        digest = first.get((row.consumer, row.source, row.message_id))
        if digest is not None and digest != row.body_digest:
            found.append((row, digest))
    return found


def report_differing(found: list[tuple[InboxMessage, str]]) -> None:
    """Log (WARNING) and count each duplicate of :func:`differing_bodies`: its
    producer reused an id, or the message was altered on its way. The inbox
    keeps the first one (handled, or kept to retry); this one is
    acknowledged without running."""
    for row, first in found:
        consume_metrics.differing(row.consumer)
        logger.warning(
            "%s: message %s from %s arrived again with another body (SHA-256 "
            "%s, the first one's %s): acknowledged as a duplicate without "
            "running; the inbox keeps the first one",
            row.consumer,
            row.message_id,
            row.source,
            row.body_digest,
            first,
            extra={"consumer": row.consumer, "message_id": row.message_id},
        )


def record_failure(
    consumer: Consumer,
    row: InboxMessage,
    body: bytes | str,
    error: BaseException,
    alias: str,
    *,
    attempt: int,
    insert: bool,
    note: str = "",
) -> Tally:
    """Record failed attempt ``attempt`` of ``row``: FAILED, due again after
    the backoff, or DEAD when out of attempts. ``insert``: the row is gone
    with the rollback of a first run (else it is updated by id)."""
    now = database_now(alias)
    retry_at = RetryPolicy.of(consumer).retry_at(error, attempt, now)
    message, error_type, text = recorded_error(error)
    values = {
        "state": InboxState.FAILED if retry_at else InboxState.DEAD,
        "attempts": attempt,
        "next_retry_at": retry_at,
        "handled_at": None,
        "body": storable(body),
        "last_error": message,
        "last_error_type": error_type,
        "last_traceback": text,
        "updated_at": now,
    }
    for name, value in values.items():
        setattr(row, name, value)
    try:
        with transaction.atomic(using=alias):
            if insert:
                row.id = None
                row.save(using=alias, force_insert=True)
            else:
                InboxMessage.objects.using(alias).filter(id=row.id).update(**values)
    except IntegrityError:
        # Another consume process handled or recorded it meanwhile.
        consume_metrics.outcome(consumer.name, "duplicate")
        report_differing(differing_bodies([row], alias))
        return Tally(duplicates=1)
    consume_metrics.failure(consumer.name, error_type)
    consume_metrics.outcome(consumer.name, "failed" if retry_at else "dead")
    level = logging.WARNING if retry_at else logging.ERROR
    logger.log(
        level,
        "%s: message %s (%s) %s after attempt %d%s: %s",
        consumer.name,
        row.message_id,
        row.event_type,
        f"failed, retry at {retry_at.isoformat()}" if retry_at else "DEAD",
        attempt,
        f" ({note})" if note else "",
        error,
        extra={"consumer": consumer.name, "message_id": row.message_id},
    )
    return Tally(failed=1) if retry_at else Tally(dead=1)


def park_undecodable(
    consumer: Consumer,
    source: str,
    key: str,
    body: bytes,
    queue: str,
    error: UndecodableMessage,
    alias: str,
) -> Tally:
    """Dead-letter an undecodable message for ``consumer`` (a duplicate if it is
    dead already)."""
    now = database_now(alias)
    try:
        with transaction.atomic(using=alias):
            InboxMessage.objects.using(alias).create(
                consumer=consumer.name,
                source=source,
                message_id=key,
                queue=storable(queue)[:255],
                state=InboxState.DEAD,
                body=storable(body),
                last_error=storable(str(error)),
                last_error_type=UNDECODABLE,
                received_at=now,
                updated_at=now,
            )
    except IntegrityError:
        consume_metrics.outcome(consumer.name, "duplicate")
        return Tally(duplicates=1)
    consume_metrics.failure(consumer.name, UNDECODABLE)
    consume_metrics.outcome(consumer.name, "dead")
    logger.error(
        "%s: undecodable message %s on %s DEAD: %s", consumer.name, key, queue, error
    )
    return Tally(dead=1)


def after_commit(ran: list[Ran], alias: str) -> Tally:
    """Run the callbacks of ``ran``, whose transaction committed, in the
    order they were registered, each guarded
    (:func:`~outbox_app.execution.run.run_callbacks`): a raising one fails its
    message (recorded as a failed attempt; the consumer's writes stay), a
    raising ``robust`` one is logged (Django's rule), and the others run all
    the same. Inside a caller's transaction they are handed back to Django,
    which runs them at its commit. Counts each message that stays handled,
    and its latency."""
    tally = Tally()
    # The latency's end: the commit, by the database's clock (one query per
    # batch, and only for a process that serves its metrics).
    now = database_now(alias) if ran and consume_metrics.enabled else None
    if connections[alias].in_atomic_block:
        for run in ran:
            for callback, robust in run.callbacks or ():
                transaction.on_commit(callback, using=alias, robust=robust)
            consume_metrics.handled(run.consumer.name, run.since, now)
        return tally
    for run in ran:
        error = None
        if run.callbacks:
            error = run_callbacks(
                run.callbacks,
                owner=run.consumer.name,
                row=f"message {run.row.message_id}",
                logger=logger,
                extra={"consumer": run.consumer.name, "message_id": run.row.message_id},
            )
        if error is None:
            consume_metrics.handled(run.consumer.name, run.since, now)
            continue
        try:
            failed = record_failure(
                run.consumer,
                run.row,
                run.body,
                error,
                alias,
                attempt=run.row.attempts,
                insert=False,
                note="its on_commit callback raised; the consumer's writes committed",
            )
        except DatabaseError:
            logger.exception(
                "%s: message %s: could not record that its on_commit callback "
                "raised (%s); it stays HANDLED",
                run.consumer.name,
                run.row.message_id,
                error,
            )
            consume_metrics.handled(run.consumer.name, run.since, now)
            continue
        tally.handled -= 1
        tally += failed
    return tally
