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
(FAILED, with the body, error and traceback: :mod:`~outbox_app.inbox.
outcomes`), then retried from the database with the relay's backoff
(:mod:`~outbox_app.inbox.retry`), and DEAD (the dead letter) after its
attempts.

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

A message the inbox cannot read (:mod:`~outbox_app.inbox.context`) is DEAD
at once as :class:`~outbox_app.exceptions.UndecodableMessage`. A message
that a recorded consumer of its queue receives and this process lacks is
kept for it (:mod:`~outbox_app.inbox.recorded`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from django.db import IntegrityError, connections, router, transaction

from ..events.cloudevents import parse
from ..events.text import storable
from ..exceptions import UndecodableMessage, renamed
from ..execution.metrics import consume_metrics
from ..execution.run import Callback, Execution, Role
from ..store.clock import database_now
from ..store.db import insert_new
from ..store.lifecycle import InboxState
from ..store.models import InboxMessage
from ..store.sql import dialect
from .context import as_bytes, columns_of, context_for, dead_key, expired, published_at
from .outcomes import (
    HELD_BACK,
    KEY,
    UNDECODABLE,
    UNIQUE,
    Ran,
    Tally,
    after_commit,
    count_outcome,
    differing_bodies,
    first_row,
    keep,
    kept_row,
    log_kept,
    park_undecodable,
    record_failure,
    report_differing,
)
from .recorded import Recorded
from .registry import ConsumeContext, Consumer

__all__ = ["CONSUMER", "Tally", "receive", "receive_batch", "run_consumer"]


#: States that hold back an ordered consumer's later messages of an aggregate.
UNFINISHED = (InboxState.FAILED, InboxState.DEAD)


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
    ran: list[Ran] = []
    tally = _receive(body, queue, consumers, message_id, alias, failures or {}, ran)
    tally += after_commit(ran, alias)
    return tally


def _receive(
    body: bytes | str,
    queue: str,
    consumers: Sequence[Consumer],
    message_id: str | None,
    alias: str,
    failures: dict[str, Exception],
    ran: list[Ran],
    recorded: Recorded | None = None,
) -> Tally:
    """:func:`receive` but the callbacks, which go to ``ran``."""
    body = as_bytes(body)
    envelope = None
    try:
        envelope = parse(body)
        columns = columns_of(envelope)
    except UndecodableMessage as exc:
        source, key = dead_key(envelope, body, message_id)
        tally = Tally()
        for consumer in consumers:
            tally += park_undecodable(consumer, source, key, body, queue, exc, alias)
        return tally
    event_type = columns["event_type"]
    mine = [c for c in consumers if c.receives(event_type)]
    recorded = recorded or Recorded([queue], alias)
    absent = recorded.absent(queue, event_type, mine)
    if not mine and not absent:
        return Tally(ignored=1)
    names = [c.name for c in mine] + absent
    if expired(envelope, database_now(alias)):
        count_outcome(names, "expired")
        return Tally(expired=len(names))
    old = _sourceless({(name, columns["message_id"]) for name in names}, alias)
    count_outcome([name for name, _ in old], "duplicate")
    tally = Tally(duplicates=len(old))
    for consumer in mine:
        if (consumer.name, columns["message_id"]) not in old:
            failure = failures.get(consumer.name)
            tally += _first(
                consumer, envelope, columns, body, queue, alias, failure, ran
            )
    for name in absent:
        if (name, columns["message_id"]) not in old:
            tally += keep(
                kept_row(name, columns, queue, body, database_now(alias)), alias
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
    ran: list[Ran] = []
    try:
        with transaction.atomic(using=alias):
            found = _together(batch, by_queue, alias, recorded, ran)
        found.report()
        tally = found.tally
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
    tally += after_commit(ran, alias)
    return tally


class _Run(NamedTuple):
    """One message of a batch for one consumer (None: kept for a recorded
    consumer this process lacks), with its inbox row."""

    index: int
    consumer: Consumer | None
    envelope: dict
    body: bytes
    queue: str
    row: InboxMessage


@dataclass
class _Found:
    """What running a batch as one found: its tally, and what is counted and
    logged only once it committed (but ``handled``, counted after the
    commit): ``(consumer, outcome)`` pairs and the duplicates whose body
    differs (:func:`differing_bodies`)."""

    tally: Tally = field(default_factory=Tally)
    counted: list[tuple[str, str]] = field(default_factory=list)
    differing: list[tuple[InboxMessage, str]] = field(default_factory=list)

    def add(self, outcome: str, names: Sequence[str]) -> None:
        """One message's ``outcome`` (a :class:`Tally` field) for each of
        ``names``."""
        setattr(self.tally, outcome, getattr(self.tally, outcome) + len(names))
        metric = _METRIC.get(outcome, outcome)
        self.counted += [(name, metric) for name in names]

    def report(self) -> None:
        """Count and log what the committed batch found."""
        for name, outcome in self.counted:
            consume_metrics.outcome(name, outcome)
        report_differing(self.differing)


#: A :class:`Tally` field -> its outcome in :data:`consume_metrics`, where
#: other than the field's name.
_METRIC = {"duplicates": "duplicate"}


def _together(
    batch, by_queue, alias: str, recorded: Recorded, ran: list[Ran]
) -> _Found:
    """The batch as one: the inbox rows in one INSERT, then the consumers,
    whose runs go to ``ran``. Raises :class:`_RunAlone` when it cannot be."""
    found = _Found()
    runs = _runs(batch, by_queue, recorded, database_now(alias), found)
    fresh = _insert(runs, alias, found)
    kept = [run.row for run in fresh if run.consumer is None]
    ordered = [run.row for run in fresh if run.consumer and run.consumer.ordered]
    if ordered and held_back(ordered, alias):
        raise _RunAlone()  # the waiting ones are recorded message by message
    for run in fresh:
        if run.consumer is None:
            continue
        context = context_for(run.envelope, run.consumer, run.queue, attempt=1)
        try:
            callbacks = run_consumer(run.consumer, context, alias)
        except Exception as exc:
            raise _RunAlone({run.index: {run.consumer.name: exc}}) from None
        since = published_at(context)
        ran.append(Ran(run.consumer, run.row, run.body, callbacks, since))
        found.tally.handled += 1
    found.add("deferred", [row.consumer for row in kept])
    log_kept(kept)
    return found


def _runs(batch, by_queue, recorded: Recorded, now, found: _Found) -> list[_Run]:
    """The batch's messages for each consumer that receives them (or is
    recorded as receiving them), with their rows; a message no consumer
    receives, one that expired and a message's second copy in the batch
    counted in ``found``. Raises :class:`_RunAlone` for an undecodable
    message (dead-lettered message by message)."""
    runs: list[_Run] = []
    # key -> the body digest of its first message in the batch
    seen: dict[tuple[str, str, str], str] = {}
    for index, (body, queue, _) in enumerate(batch):
        body = as_bytes(body)
        try:
            envelope = parse(body)
            columns = columns_of(envelope)
        except UndecodableMessage:
            raise _RunAlone() from None
        mine = [c for c in by_queue.get(queue, ()) if c.receives(columns["event_type"])]
        absent = recorded.absent(queue, columns["event_type"], mine)
        if not mine and not absent:
            found.tally.ignored += 1
            continue
        if expired(envelope, now):
            found.add("expired", [c.name for c in mine] + absent)
            continue
        for consumer, name in [(c, c.name) for c in mine] + [(None, n) for n in absent]:
            key = (name, columns["source"], columns["message_id"])
            if key in seen:
                found.add("duplicates", [name])
                if seen[key] != columns["body_digest"]:
                    row = first_row(name, columns, queue, now)
                    found.differing.append((row, seen[key]))
                continue
            seen[key] = columns["body_digest"]
            if consumer is None:
                row = kept_row(name, columns, queue, body, now)
            else:
                row = first_row(name, columns, queue, now)
            runs.append(_Run(index, consumer, envelope, body, queue, row))
    return runs


def _insert(runs: list[_Run], alias: str, found: _Found) -> list[_Run]:
    """INSERT the rows of ``runs`` in one statement that skips the
    duplicates (and those a row recorded without a source stops); returns
    the runs whose row it wrote, each with its id, the others counted in
    ``found``. Raises :class:`_RunAlone` where the database has no
    ``INSERT ... RETURNING`` (a savepoint each, then)."""
    old = _sourceless({(run.row.consumer, run.row.message_id) for run in runs}, alias)
    if old:

        def stopped(run: _Run) -> bool:
            return (run.row.consumer, run.row.message_id) in old

        found.add("duplicates", [run.row.consumer for run in runs if stopped(run)])
        runs = [run for run in runs if not stopped(run)]
    if not runs:
        return []
    inserted = insert_new([run.row for run in runs], ["id", *KEY], alias)
    if inserted is None:
        raise _RunAlone()
    ids = {tuple(key): pk for pk, *key in inserted}
    for run in runs:
        run.row.id = ids.get((run.row.consumer, run.row.source, run.row.message_id))
    taken = [run.row for run in runs if run.row.id is None]
    found.add("duplicates", [row.consumer for row in taken])
    found.differing += differing_bodies(taken, alias)
    return [run for run in runs if run.row.id is not None]


def run_consumer(
    consumer: Consumer, context: ConsumeContext, alias: str
) -> list[Callback] | None:
    """Call ``consumer`` with ``context``'s event, within its ``timeout`` and
    its span (:class:`~outbox_app.execution.run.Execution`), in the caller's
    atomic block, which its error rolls back.

    Returns:
        The ``on_commit`` callbacks it registered, taken out of the
        connection's list when one is not ``robust``: the inbox runs them
        after the commit (:func:`after_commit`). None: Django runs them.

    Raises:
        CallTimeout: it ran longer than its ``timeout`` (even if it caught
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


def _first(
    consumer: Consumer,
    envelope: dict,
    columns: dict[str, str],
    body: bytes,
    queue: str,
    alias: str,
    failure: Exception | None,
    ran: list[Ran],
) -> Tally:
    """The first run of a message for ``consumer``: the inbox row first, then
    the consumer, in one transaction. ``failure``: what the consumer raised
    for it already (see :func:`receive`)."""
    now = database_now(alias)
    row = first_row(consumer.name, columns, queue, now)
    context = context_for(envelope, consumer, queue, attempt=1)
    try:
        with transaction.atomic(using=alias):
            row.save(using=alias, force_insert=True)  # first: a duplicate stops here
            if consumer.ordered and held_back([row], alias):
                row.state, row.attempts, row.handled_at = InboxState.FAILED, 0, None
                row.next_retry_at, row.body, row.last_error = (
                    now,
                    storable(body),
                    HELD_BACK,
                )
                row.save(using=alias)
                consume_metrics.outcome(consumer.name, "waiting")
                return Tally(waiting=1)
            if failure is not None:
                raise failure
            callbacks = run_consumer(consumer, context, alias)
    except IntegrityError as exc:
        if dialect(alias).violated_constraint(exc, InboxMessage) == UNIQUE:
            consume_metrics.outcome(consumer.name, "duplicate")
            report_differing(differing_bodies([row], alias))
            return Tally(duplicates=1)
        return record_failure(consumer, row, body, exc, alias, attempt=1, insert=True)
    except Exception as exc:
        return record_failure(consumer, row, body, exc, alias, attempt=1, insert=True)
    ran.append(Ran(consumer, row, body, callbacks, published_at(context)))
    return Tally(handled=1)


def held_back(rows: list[InboxMessage], alias: str) -> bool:
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


__getattr__ = renamed(__name__, {"WAITING": "HELD_BACK"})
