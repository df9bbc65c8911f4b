"""The transactional inbox: one consumed message, once per consumer.

For each consumer of a message's type, one transaction holds, first, the
INSERT of the inbox row ``(consumer, source, message id)`` (CloudEvents ids
are unique per source) and then the consumer's own writes; both commit or
neither does. The broker's ack is sent by the caller after every consumer's
transaction (``inbox/worker.py``), so a crash at any point either leaves the
message unacknowledged (the broker redelivers it; the rolled-back consumer
runs again) or committed (the redelivery finds the row and is acknowledged
without running the consumer: a duplicate). A row recorded without its
source (before the inbox kept it) still stops a redelivery of its id. The
row keeps the SHA-256 of its CloudEvent (``body_digest``): a duplicate with
another body than the first message of its id (a producer reusing ids) is
acknowledged all the same, the first one kept, and logged (WARNING) and
counted (``outbox_consume_differing_duplicates_total``).

:func:`receive_batch` runs what the broker sent at once in one transaction:
one INSERT of every inbox row that skips the duplicates and returns the rows
it wrote (``db.insert_new``), the consumers of those rows one after another,
one COMMIT. Should a consumer raise (or an ordered consumer's aggregate be
held back, or the database have no ``INSERT ... RETURNING``) the batch is
rolled back and run again message by message, each in a savepoint of its own
(:func:`receive`): the consumers before the failing one run again, their
first writes having been rolled back, and the failing one is not called twice
for one attempt.

A consumer that raises is rolled back and its message kept in the inbox row
(FAILED, with the body, error and traceback), then retried from the database
with the relay's backoff (:func:`retry_due`), and DEAD (the dead letter)
after its attempts. Retrying from the database rather than by broker
redelivery: a failing message is acknowledged and never blocks the queue nor
spins in a redelivery loop, the attempts are counted whatever the broker
(classic RabbitMQ queues and Redis count none), and the dead letter is in the
same place as the relay's, requeueable from the admin.

A consumer runs as a handler does
(:class:`~outbox_app.execution.run.Execution`, the :data:`CONSUMER` role):
within its ``timeout``, in a span (``outbox consume <type>``), timed and
counted in :data:`consume_metrics` (its messages' outcomes: handled, failed,
dead, duplicate, waiting, expired, deferred; a handled message's latency from
its publish). Its ``transaction.on_commit`` callbacks, when one is not
``robust``, are taken out of Django's list as it returns and run by the inbox
after the commit, in order, each guarded: one that raises fails its own
message as a raising consumer does (FAILED with the callback's error,
retried: the consumer runs again with its first writes committed, so a
consumer with such side effects runs at least once and must be idempotent),
and every other callback still runs. Only ``robust`` ones are left to Django,
which runs them at the commit and logs their errors.

A message that is not a CloudEvents 1.0 event (another ``specversion``
included), or whose attributes the inbox cannot
store (``id``, ``source``, ``type``, ``subject``, ``aggregatetype``: not a
string, holding NUL, longer than the column), is DEAD at once as
:class:`~outbox_app.exceptions.UndecodableMessage`, keyed by the body's
SHA-256 when its own key is unusable. A message that a recorded consumer of
its queue receives and this process lacks is kept for it
(:mod:`~outbox_app.inbox.recorded`). Every outside text stored passes through
:func:`~outbox_app.events.text.storable`.
"""

from __future__ import annotations

import datetime
import functools
import hashlib
import logging
import operator
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from django.db import DatabaseError, IntegrityError, connections, router, transaction
from django.db.models import Exists, OuterRef, Q

from ..events.cloudevents import COLUMNS, parse, parse_time, read
from ..events.text import storable, unstorable
from ..exceptions import UndecodableMessage
from ..execution.metrics import Counts, consume_metrics
from ..execution.retry import RetryPolicy
from ..execution.run import Callback, Execution, Role, recorded_error, run_callbacks
from ..store.clock import database_now
from ..store.db import insert_new
from ..store.lifecycle import InboxState
from ..store.models import InboxMessage
from ..store.sql import dialect
from ..subscribers import dotted_path
from .recorded import Recorded
from .registry import ConsumeContext, Consumer

logger = logging.getLogger("outbox_app.inbox")

#: The inbox's unique key: (consumer, source, message_id).
UNIQUE = "outbox_inbox_key"
KEY = ("consumer", "source", "message_id")
UNDECODABLE = dotted_path(UndecodableMessage)
#: States that hold back an ordered consumer's later messages of an aggregate.
UNFINISHED = (InboxState.FAILED, InboxState.DEAD)
WAITING = "waiting behind an earlier message of its aggregate (ordered consumer)"


def context_for(
    envelope: dict[str, Any], consumer: Consumer, queue: str, attempt: int
) -> ConsumeContext:
    """The context of ``envelope`` (a parsed CloudEvent) for ``consumer``:
    its attributes read back into their fields
    (:func:`~outbox_app.events.cloudevents.read`)."""
    fields_ = read(envelope)
    try:
        event_id = uuid.UUID(fields_["message_id"])
    except ValueError:
        event_id = None
    return ConsumeContext(
        **fields_,
        event_id=event_id,
        envelope=envelope,
        attempt=attempt,
        consumer=consumer.name,
        queue=queue,
    )


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


def _span(consumer: Consumer, context: ConsumeContext) -> tuple[str, dict]:
    """A consumer call's span: ``outbox consume <event type>``, named by the
    consumer (the ``consumer.group``), the queue and the message id."""
    return f"outbox consume {context.event_type}", {
        "messaging.system": "outbox_app",
        "messaging.operation.type": "process",
        "messaging.destination.name": context.queue,
        "messaging.consumer.group.name": consumer.name,
        "messaging.message.id": context.message_id,
        "outbox.attempt": context.attempt,
    }


#: Consumers run in the atomic block that holds their inbox row.
CONSUMER = Role("consumer", savepoint=False, span=_span, metrics=consume_metrics)


@dataclass
class _Ran:
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


def _since(context: ConsumeContext) -> datetime.datetime | None:
    """When ``context``'s event was published, or scheduled for."""
    return context.deliver_at or context.occurred_at


def _count(names: Sequence[str], outcome: str) -> None:
    """One message's ``outcome`` for each consumer of ``names``, in
    :data:`consume_metrics`."""
    for name in names:
        consume_metrics.outcome(name, outcome)


def receive(
    body: bytes | str,
    queue: str,
    consumers: Sequence[Consumer],
    *,
    message_id: str | None = None,
    using: str | None = None,
    failures: dict[str, Exception] | None = None,
) -> Tally:
    """Run one message through the inbox for each of ``consumers`` (those of
    ``queue``) that receives its type, then the ``on_commit`` callbacks they
    registered (see the module's docstring; inside a caller's transaction,
    Django runs them at its commit). The caller acknowledges the message
    afterwards, whatever the tally says.

    Args:
        body: the message body (a CloudEvents JSON document; kombu hands
            some transports' bodies over decoded).
        queue: where it came from.
        consumers: the consumers of that queue.
        message_id: the broker's message id, the key of an undecodable body
            (default, or when the inbox cannot store it: the body's SHA-256).
        using: database alias; default the router's for InboxMessage.
        failures: consumer name -> what it raised for this message in a
            batch rolled back (:func:`receive_batch`): recorded as that
            attempt's failure without calling the consumer again.

    Returns:
        What happened, per consumer.

    Raises:
        django.db.DatabaseError: the database failed (nothing for this message
            committed except what the tally counts); the caller does not
            acknowledge the message, so the broker delivers it again.
    """
    alias = using or router.db_for_write(InboxMessage)
    ran: list[_Ran] = []
    tally = _receive(body, queue, consumers, message_id, alias, failures or {}, ran)
    tally += _after_commit(ran, alias)
    return tally


def _receive(
    body: bytes | str,
    queue: str,
    consumers: Sequence[Consumer],
    message_id: str | None,
    alias: str,
    failures: dict[str, Exception],
    ran: list[_Ran],
    recorded: Recorded | None = None,
) -> Tally:
    """:func:`receive` but the callbacks, which go to ``ran``."""
    body = _bytes(body)
    envelope = None
    try:
        envelope = parse(body)
        columns = _columns(envelope)
    except UndecodableMessage as exc:
        source, key = _dead_key(envelope, body, message_id)
        tally = Tally()
        for consumer in consumers:
            tally += _park_undecodable(consumer, source, key, body, queue, exc, alias)
        return tally
    event_type = columns["event_type"]
    mine = [c for c in consumers if c.receives(event_type)]
    recorded = recorded or Recorded([queue], alias)
    absent = recorded.absent(queue, event_type, mine)
    if not mine and not absent:
        return Tally(ignored=1)
    names = [c.name for c in mine] + absent
    if _expired(envelope, database_now(alias)):
        _count(names, "expired")
        return Tally(expired=len(names))
    old = _sourceless({(name, columns["message_id"]) for name in names}, alias)
    _count([name for name, _ in old], "duplicate")
    tally = Tally(duplicates=len(old))
    for consumer in mine:
        if (consumer.name, columns["message_id"]) not in old:
            failure = failures.get(consumer.name)
            tally += _first(
                consumer, envelope, columns, body, queue, alias, failure, ran
            )
    for name in absent:
        if (name, columns["message_id"]) not in old:
            tally += _keep(
                _kept_row(name, columns, queue, body, database_now(alias)), alias
            )
    return tally


class _RunAlone(Exception):
    """:func:`receive_batch` cannot run the batch as one: run it message by
    message, with the failures its consumers raised (message index ->
    consumer name -> exception)."""

    def __init__(self, failures: dict[int, dict[str, Exception]] | None = None):
        super().__init__()
        self.failures = failures or {}


def receive_batch(
    batch: Sequence[tuple[bytes | str, str, str | None]],
    by_queue: dict[str, Sequence[Consumer]],
    *,
    using: str | None = None,
) -> Tally:
    """Run ``batch`` (``(body, queue, broker message id)`` in arrival order)
    through the inbox as :func:`receive` runs one message, in one transaction
    (see the module's docstring), then the ``on_commit`` callbacks its
    consumers registered. The caller acknowledges every message afterwards,
    whatever the tally says.

    Args:
        by_queue: queue name -> its consumers (a message of a queue missing
            here is ``ignored``, unless a recorded consumer receives it).
        using: database alias; default the router's for InboxMessage.

    Returns:
        What happened, per message and consumer.

    Raises:
        django.db.DatabaseError: the database failed; nothing of the batch
            committed, so the caller hands every message back.
    """
    alias = using or router.db_for_write(InboxMessage)
    recorded = Recorded({queue for _, queue, _ in batch}, alias)
    ran: list[_Ran] = []
    counted: list[tuple[str, str]] = []
    differing: list[tuple[InboxMessage, str]] = []
    try:
        with transaction.atomic(using=alias):
            tally = _together(batch, by_queue, alias, recorded, ran, counted, differing)
        for name, outcome in counted:
            consume_metrics.outcome(name, outcome)
        _report_differing(differing)
    except _RunAlone as alone:
        failures = alone.failures
        ran = []
        tally = Tally()
        with transaction.atomic(using=alias):
            for index, (body, queue, message_id) in enumerate(batch):
                tally += _receive(
                    body,
                    queue,
                    by_queue.get(queue, ()),
                    message_id,
                    alias,
                    failures.get(index, {}),
                    ran,
                    recorded,
                )
    tally += _after_commit(ran, alias)
    return tally


def _together(
    batch, by_queue, alias: str, recorded: Recorded, ran, counted: list, differing
) -> Tally:
    """The batch as one: the inbox rows in one INSERT, then the consumers.
    The outcomes it tallies (but ``handled``, counted after the commit) go
    to ``counted`` as ``(consumer, outcome)``, and its duplicates whose body
    differs to ``differing`` (:func:`_differing`), for the caller to count
    and log once the batch committed. Raises :class:`_RunAlone` when it
    cannot be."""
    tally = Tally()
    now = database_now(alias)
    # (message index, consumer or None: kept for an absent one, envelope,
    # body, queue, row)
    runs: list[tuple[int, Consumer | None, dict, bytes, str, InboxMessage]] = []
    # key -> the body digest of its first message in the batch
    seen: dict[tuple[str, str, str], str] = {}
    for index, (body, queue, _) in enumerate(batch):
        body = _bytes(body)
        try:
            envelope = parse(body)
            columns = _columns(envelope)
        except UndecodableMessage:
            raise _RunAlone() from None  # dead-lettered message by message
        mine = [c for c in by_queue.get(queue, ()) if c.receives(columns["event_type"])]
        absent = recorded.absent(queue, columns["event_type"], mine)
        if not mine and not absent:
            tally.ignored += 1
            continue
        if _expired(envelope, now):
            tally.expired += len(mine) + len(absent)
            counted += [(name, "expired") for name in [c.name for c in mine] + absent]
            continue
        for consumer, name in [(c, c.name) for c in mine] + [(None, n) for n in absent]:
            key = (name, columns["source"], columns["message_id"])
            if key in seen:
                tally.duplicates += 1
                counted.append((name, "duplicate"))
                if seen[key] != columns["body_digest"]:
                    differing.append((_row(name, columns, queue, now), seen[key]))
                continue
            seen[key] = columns["body_digest"]
            if consumer is None:
                row = _kept_row(name, columns, queue, body, now)
            else:
                row = _row(name, columns, queue, now)
            runs.append((index, consumer, envelope, body, queue, row))
    old = _sourceless({(run[-1].consumer, run[-1].message_id) for run in runs}, alias)
    if old:
        remaining = []
        for run in runs:
            if (run[-1].consumer, run[-1].message_id) in old:
                tally.duplicates += 1
                counted.append((run[-1].consumer, "duplicate"))
            else:
                remaining.append(run)
        runs = remaining
    if not runs:
        return tally
    inserted = insert_new([run[-1] for run in runs], ["id", *KEY], alias)
    if inserted is None:
        raise _RunAlone()  # no INSERT ... RETURNING here: a savepoint each
    ids = {tuple(key): pk for pk, *key in inserted}
    fresh = []
    for run in runs:
        row = run[-1]
        row.id = ids.get((row.consumer, row.source, row.message_id))
        if row.id is not None:
            fresh.append(run)
    tally.duplicates += len(runs) - len(fresh)
    counted += [(run[-1].consumer, "duplicate") for run in runs if run[-1].id is None]
    differing += _differing([run[-1] for run in runs if run[-1].id is None], alias)
    kept = [row for _, consumer, *_, row in fresh if consumer is None]
    ordered = [row for _, consumer, *_, row in fresh if consumer and consumer.ordered]
    if ordered and _held_back(ordered, alias):
        raise _RunAlone()  # the waiting ones are recorded message by message
    for index, consumer, envelope, body, queue, row in fresh:
        if consumer is None:
            continue
        context = context_for(envelope, consumer, queue, attempt=1)
        try:
            callbacks = _run(consumer, context, alias)
        except Exception as exc:
            raise _RunAlone({index: {consumer.name: exc}}) from None
        ran.append(_Ran(consumer, row, body, callbacks, _since(context)))
        tally.handled += 1
    tally.deferred += len(kept)
    counted += [(row.consumer, "deferred") for row in kept]
    _log_kept(kept)
    return tally


def _run(
    consumer: Consumer, context: ConsumeContext, alias: str
) -> list[Callback] | None:
    """Call ``consumer`` with ``context``'s event, within its ``timeout`` and
    its span (:class:`~outbox_app.execution.run.Execution`), in the caller's
    atomic block, which its error rolls back.

    Returns:
        The ``on_commit`` callbacks it registered, taken out of the
        connection's list when one is not ``robust``: the inbox runs them
        after the commit (:func:`_after_commit`). None: Django runs them.

    Raises:
        HandlerTimeout: it ran longer than its ``timeout`` (even if it caught
            the exception and returned).
        TransactionBroken: it returned, but its writes cannot commit.
        Exception: what it raised, or its event's decoding error (the
            rollback of the caller's block discards its callbacks).
    """
    execution = Execution(CONSUMER, consumer, connections[alias], take_callbacks=True)
    with execution.installed():
        error, _, callbacks = execution.run(context)
    if error is not None:
        raise error
    return callbacks


def _after_commit(ran: list[_Ran], alias: str) -> Tally:
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
            failed = _failed(
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

    Returns:
        What happened (``handled``, ``failed``, ``dead``).
    """
    alias = using or router.db_for_write(InboxMessage)
    by_name = {c.name: c for c in consumers}
    tally = Tally()
    if not by_name:
        return tally
    theirs = functools.reduce(
        operator.or_,
        (
            Q(consumer=c.name)
            if c.event_types is None
            # "": an undecodable message, requeued: it is dead-lettered again.
            else Q(consumer=c.name, event_type__in=sorted({*c.event_types, ""}))
            for c in by_name.values()
        ),
    )
    earlier = InboxMessage.objects.filter(
        consumer=OuterRef("consumer"),
        aggregate_type=OuterRef("aggregate_type"),
        aggregate_id=OuterRef("aggregate_id"),
        state__in=UNFINISHED,
        id__lt=OuterRef("id"),
    )
    ordered = [name for name, c in by_name.items() if c.ordered]
    runnable = theirs & (
        ~Q(consumer__in=ordered) | Q(aggregate_id="") | ~Exists(earlier)
    )
    for _ in range(limit):
        moment = now or database_now(alias)
        due = (
            InboxMessage.objects.using(alias)
            .filter(runnable, state=InboxState.FAILED, next_retry_at__lte=moment)
            .order_by("next_retry_at", "id")
        )
        # The row stays locked until its outcome is written: no other consume
        # process runs it meanwhile. The consumer runs in a savepoint, so a
        # failure undoes its writes only.
        with transaction.atomic(using=alias):
            row = due.select_for_update(skip_locked=True).first()
            if row is None:
                return tally
            consumer, body = by_name[row.consumer], row.body
            try:
                with transaction.atomic(using=alias):
                    envelope = parse(body)
                    context = context_for(
                        envelope, consumer, row.queue, row.attempts + 1
                    )
                    callbacks = _run(consumer, context, alias)
            except Exception as exc:
                tally += _failed(
                    consumer,
                    row,
                    body,
                    exc,
                    alias,
                    attempt=row.attempts + 1,
                    insert=False,
                )
                continue
            row.state, row.attempts = InboxState.HANDLED, row.attempts + 1
            row.handled_at = row.updated_at = database_now(alias)
            row.next_retry_at, row.body = None, ""
            row.save(using=alias)
        tally.handled += 1
        ran = _Ran(consumer, row, body, callbacks, _since(context))
        tally += _after_commit([ran], alias)
    return tally


def _bytes(body: bytes | str) -> bytes:
    """A body kombu handed over decoded, as bytes (a lone surrogate kept as
    bytes no UTF-8 decoder takes: the body is undecodable)."""
    return body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body


def _columns(envelope: dict) -> dict[str, str]:
    """The inbox columns of ``envelope``'s attributes (:data:`COLUMNS`; an
    absent optional one: empty), and its ``body_digest``: the SHA-256 of
    the envelope as JSON with sorted keys, so the same CloudEvent spaced or
    ordered otherwise by its producer has the same one.

    Raises:
        UndecodableMessage: an attribute the inbox cannot store, named.
    """
    columns = {}
    for attribute, column in COLUMNS.items():
        value = envelope.get(attribute)
        value = "" if value is None else value
        problem = _unstorable(value, column)
        if problem:
            raise UndecodableMessage(
                f"the inbox cannot store this CloudEvent: {attribute} {problem}"
            )
        columns[column] = value
    canonical = orjson.dumps(envelope, option=orjson.OPT_SORT_KEYS)
    columns["body_digest"] = hashlib.sha256(canonical).hexdigest()
    return columns


def _unstorable(value: Any, column: str) -> str | None:
    """Why ``value`` cannot be stored in the InboxMessage ``column`` as it
    is (never silently changed: it is a key or what an operator looks for),
    or None."""
    return unstorable(value, InboxMessage._meta.get_field(column).max_length)


def _dead_key(
    envelope: dict | None, body: bytes, message_id: str | None
) -> tuple[str, str]:
    """``(source, message id)`` of an undecodable message's rows: the
    CloudEvent's own when it has a usable pair, else the broker's message id
    with no source, else the body's SHA-256."""
    if envelope is not None and not (
        _unstorable(envelope.get("source"), "source")
        or _unstorable(envelope.get("id"), "message_id")
    ):
        return envelope["source"], envelope["id"]
    if message_id is not None and not _unstorable(message_id, "message_id"):
        return "", message_id
    return "", hashlib.sha256(body).hexdigest()


def _sourceless(pairs: set[tuple[str, str]], alias: str) -> set[tuple[str, str]]:
    """Which of ``pairs`` (consumer, message id) have a row recorded without
    a source (by a version that did not keep it): that row is the message's,
    whatever its source. An undecodable message's row (keyed by the broker's
    id) is not. One query."""
    if not pairs:
        return set()
    found = (
        InboxMessage.objects.using(alias)
        .filter(
            source="",
            consumer__in={name for name, _ in pairs},
            message_id__in={message_id for _, message_id in pairs},
        )
        .exclude(last_error_type=UNDECODABLE)
        .values_list("consumer", "message_id")
    )
    return set(found) & pairs


def _row(name: str, columns: dict[str, str], queue: str, now, **values) -> InboxMessage:
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


def _kept_row(name: str, columns, queue: str, body: bytes, now) -> InboxMessage:
    """The row of a message kept for ``name``, a recorded consumer this
    process lacks: FAILED, due now, no attempt counted, the body kept."""
    return _row(
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


def _keep(row: InboxMessage, alias: str) -> Tally:
    """Insert ``row`` (:func:`_kept_row`); a duplicate if it is there."""
    try:
        with transaction.atomic(using=alias):
            row.save(using=alias, force_insert=True)
    except IntegrityError as exc:
        if dialect(alias).violated_constraint(exc, InboxMessage) == UNIQUE:
            consume_metrics.outcome(row.consumer, "duplicate")
            _report_differing(_differing([row], alias))
            return Tally(duplicates=1)
        raise
    _log_kept([row])
    consume_metrics.outcome(row.consumer, "deferred")
    return Tally(deferred=1)


def _log_kept(rows: list[InboxMessage]) -> None:
    names = sorted({row.consumer for row in rows})
    if names:
        logger.warning(
            "%d message(s) kept for %s, which this consume process lacks "
            "(recorded by another one): a process that has it runs them",
            len(rows),
            ", ".join(names),
        )


def _differing(
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


def _report_differing(found: list[tuple[InboxMessage, str]]) -> None:
    """Log (WARNING) and count each duplicate of :func:`_differing`: its
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


def _first(
    consumer: Consumer,
    envelope: dict,
    columns: dict[str, str],
    body: bytes,
    queue: str,
    alias: str,
    failure: Exception | None,
    ran: list[_Ran],
) -> Tally:
    """The first run of a message for ``consumer``: the inbox row first, then
    the consumer, in one transaction. ``failure``: what the consumer raised
    for it already (see :func:`receive`)."""
    now = database_now(alias)
    row = _row(consumer.name, columns, queue, now)
    context = context_for(envelope, consumer, queue, attempt=1)
    try:
        with transaction.atomic(using=alias):
            row.save(using=alias, force_insert=True)  # first: a duplicate stops here
            if consumer.ordered and _held_back([row], alias):
                row.state, row.attempts, row.handled_at = InboxState.FAILED, 0, None
                row.next_retry_at, row.body, row.last_error = (
                    now,
                    storable(body),
                    WAITING,
                )
                row.save(using=alias)
                consume_metrics.outcome(consumer.name, "waiting")
                return Tally(waiting=1)
            if failure is not None:
                raise failure
            callbacks = _run(consumer, context, alias)
    except IntegrityError as exc:
        if dialect(alias).violated_constraint(exc, InboxMessage) == UNIQUE:
            consume_metrics.outcome(consumer.name, "duplicate")
            _report_differing(_differing([row], alias))
            return Tally(duplicates=1)
        return _failed(consumer, row, body, exc, alias, attempt=1, insert=True)
    except Exception as exc:
        return _failed(consumer, row, body, exc, alias, attempt=1, insert=True)
    ran.append(_Ran(consumer, row, body, callbacks, _since(context)))
    return Tally(handled=1)


def _expired(envelope: dict, now: datetime.datetime) -> bool:
    """The message arrived after its ``expiretime``: its producer asked that
    it not be delivered any more (CloudEvents' expiry extension). Logged at
    DEBUG; the consume summary counts them."""
    expires = parse_time(envelope.get("expiretime"))
    if expires is None or expires > now:
        return False
    logger.debug(
        "message %s (%s) expired at %s: not run",
        envelope["id"],
        envelope["type"],
        expires.isoformat(),
    )
    return True


def _held_back(rows: list[InboxMessage], alias: str) -> bool:
    """An earlier message of one of ``rows``' aggregates is still FAILED or
    DEAD for its consumer (``rows`` are HANDLED or not saved: never one of
    those), one query."""
    keys = {(r.consumer, r.aggregate_type, r.aggregate_id) for r in rows}
    ids = {aggregate_id for _, _, aggregate_id in keys if aggregate_id}
    if not ids:
        return False
    unfinished = InboxMessage.objects.using(alias).filter(
        consumer__in={consumer for consumer, _, _ in keys},
        aggregate_id__in=ids,
        state__in=UNFINISHED,
    )
    found = unfinished.values_list("consumer", "aggregate_type", "aggregate_id")
    return not keys.isdisjoint(found)


def _failed(
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
        _report_differing(_differing([row], alias))
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


def _park_undecodable(
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
