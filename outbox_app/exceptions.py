"""Every exception outbox_app raises.

All of them derive from :class:`OutboxError`, so ``except OutboxError`` catches
anything the app refuses. Configuration mistakes also derive from Django's
``ImproperlyConfigured`` and bad input from ``ValueError``, so generic handlers
keep working.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

from django.core.exceptions import ImproperlyConfigured


class OutboxError(Exception):
    """Base class of every exception raised by outbox_app."""


# --- publishing -----------------------------------------------------------------


class OutboxRequiresActiveTransaction(OutboxError):
    """``publish()`` (or ``outbox_action``'s sentinel row) ran outside
    ``transaction.atomic`` on the database alias it writes to.

    The outbox guarantee is that the event commits with the state change; outside
    a transaction there is nothing to commit with, so nothing is written.
    """


class DuplicateOutboxEvent(OutboxError):
    """An outbox event with the same id already exists (primary key clash)."""


class DuplicateAggregateVersion(OutboxError):
    """Two outbox events share ``(aggregate_type, aggregate_id, aggregate_version)``.

    Usually two writers raced on one aggregate without a lock: the loser should
    retry its whole transaction.
    """


class AggregateVersionConflict(DuplicateAggregateVersion):
    """A stale ``save()`` of a versioned aggregate (a
    :class:`~outbox_app.RecordsEvents` model with ``outbox_version_field``):
    its row was saved since this instance was loaded, at another version.

    Optimistic locking: raised by every save of such a model whose stored
    version is not the one the instance holds, with or without recorded
    events, before anything is written (the save's UPDATE matched no row at
    that version). The stored row, its version and the outbox are left as
    they were, and so are the instance's fields and recorded events: reload
    it (``refresh_from_db()`` or a new query), apply the change again and
    save. A subclass of :class:`DuplicateAggregateVersion`, so code that
    retries on that catches this too.
    """


class InvalidEvent(OutboxError, ValueError):
    """An event was refused before anything was written."""


class InvalidEventType(InvalidEvent):
    """An event type is empty, longer than 255 characters, or not a string."""


class InvalidPayload(InvalidEvent):
    """A payload is not JSON-serialisable; ``field`` names the offending field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class PayloadTooLarge(InvalidPayload):
    """An encoded payload is larger than ``OUTBOX_MAX_PAYLOAD_BYTES``."""


class InvalidSchedule(InvalidEvent):
    """``deliver_at`` or ``expires_at`` given to ``publish()`` is not an aware
    datetime or a timedelta, or the event would expire before it is due or
    has expired already."""


class UnsupportedTask(InvalidEvent):
    """``enqueue()`` was given what it cannot send as one task: a Celery
    canvas of several tasks (a chain, a group, a chord: enqueue each task, or
    run the canvas from a task you enqueue), an option the outbox sets itself
    (``task_id``: the task's id is the outbox event's), or something that is
    not a Celery signature. Nothing is written."""


class UnsupportedTaskArgument(UnsupportedTask, InvalidPayload):
    """An argument given to ``enqueue()`` that Celery's JSON serializer
    (kombu's) cannot write (a set, an arbitrary object: ``delay()`` refuses
    it too) or that the outbox cannot store although that JSON writes it (a
    NaN or infinite float); ``field`` names it (``args[1]``, ``kwargs.who``).
    Nothing is written. Both an :class:`UnsupportedTask` and an
    :class:`InvalidPayload`."""


class NoTaskPublisher(OutboxError, ImproperlyConfigured):
    """``enqueue()`` was called while no ``OUTBOX_PUBLISHERS`` entry has the
    backend ``outbox_app.publishers.celery.CeleryPublisher``: no relay would
    ever send the task. Nothing is written."""


class UntrackedWrite(OutboxError):
    """A write to a tracked model (``@outbox_app.track``) that cannot publish
    its change events: a ``bulk_create()`` ignoring conflicts or updating them,
    or on a database that returns no new primary keys. Raised before anything
    is written; the message names the alternatives (``save()`` each object,
    or the statement inside ``outbox_app.publishing.tracking.untracked()`` with an event
    of your own)."""


class DuplicateEventType(OutboxError, ImproperlyConfigured):
    """Two different event classes claim the same ``event_type`` in one process.

    Raised when the second class is created; the message names both classes.
    """


# --- reading events back ----------------------------------------------------------


class EventDecodeError(OutboxError):
    """An event cannot be decoded: its payload cannot be turned back into its
    event, or (:class:`UndecodableMessage`, a subclass) a consumed message is
    not one at all.

    The type is unknown, a revision has no upcaster, or the payload no longer
    fits the class (a renamed or missing field). The relay and ``consume``
    record it as the attempt's failure, retried as any other (a deploy that
    adds the upcaster or the field makes a later attempt succeed); other
    deliveries are not affected.
    """


# --- delivering -------------------------------------------------------------------


class LeaseLost(OutboxError):
    """A worker's lease on a delivery expired and another worker claimed it.

    The worker's outcome is discarded (and, for a handler, its database writes
    are rolled back); the new lease holder owns the row.
    """


class CallTimeout(OutboxError):
    """A call of user code, a handler's or a consumer's, ran longer than its
    ``timeout`` (seconds) and was interrupted: a failed attempt, recorded
    with this error type; the message says which handler or consumer. (It
    was ``HandlerTimeout`` before; that name still works for one release.)"""


class DeliveryError(OutboxError):
    """A publisher could not deliver an event: the broker refused it, did not
    confirm it in time, returned it as unroutable, or the connection dropped.

    The message is the reason recorded on the delivery.
    """


class TransactionBroken(DeliveryError):
    """A handler or consumer returned, but left its transaction unable to
    commit what it wrote: Django marked it for rollback (a database error
    caught inside ``atomic()``, or ``transaction.set_rollback(True)``), or
    PostgreSQL aborted it (a database error caught with no savepoint around
    it, after which a COMMIT rolls back without an error). Its writes are
    rolled back and the attempt fails as if it had raised; the message says
    which of the two."""


class PublisherUnavailable(DeliveryError):
    """The destination itself failed, not the message: the connection was
    refused or reset, the channel closed, the broker did not confirm in time,
    or the JetStream stream the publisher writes to does not exist.

    The relay pauses that publisher as a whole (capped, jittered backoff, one
    log line per change), hands the batch back without counting an attempt,
    and resumes once a probe connects again (docs/relay.md, "Outages"). A
    custom publisher raises it (or returns it as a message's outcome) for an
    outage of its destination.
    """


class UndeliverableMessage(DeliveryError):
    """This message can never be sent as it is: it cannot be encoded (a routing
    key, or an AMQP ``type`` or ``message_id``, over 255 UTF-8 bytes; a field
    the routing-key template needs is missing), or it is larger than the
    broker takes (RabbitMQ's ``max_message_size``, NATS's ``max_payload``).

    Retrying cannot help, so the delivery goes to the dead letter at once with the
    reason (an operator fixes the cause, then requeues it); the rest of its
    batch is delivered and the publisher is not paused.
    """


class MessageUnroutable(DeliveryError):
    """The broker returned the message: no queue is bound for its routing key
    (RabbitMQ ``basic.return`` of a ``mandatory`` publish, ``NO_ROUTE``); or
    no JetStream stream answered for its subject while the publisher's
    ``STREAM`` exists, or another stream captures it (NATS; the message names
    the stream and the subject).

    An attempt: the delivery is FAILED and retried with backoff (a queue
    bound meanwhile gets it), DEAD after ``OUTBOX_MAX_ATTEMPTS``. Its type,
    ``outbox_app.exceptions.MessageUnroutable``, is what ``outbox_requeue
    --error-type`` and the admin's "last error type" filter select.
    """


class MessageRejected(DeliveryError):
    """The broker refused to take the message (RabbitMQ ``basic.nack``: a
    queue full with ``x-overflow: reject-publish``, an internal error;
    JetStream's error reply: a stream limit with ``discard: new``, say).

    An attempt, retried with backoff like :class:`MessageUnroutable`.
    """


class EventExpired(DeliveryError):
    """The event's ``expires_at`` passed before this delivery was made: the
    delivery is SKIPPED with this error type, never delivered. Not
    raised: it names the reason on the row (admin, ``--error-type``)."""


# --- consuming (the inbox) --------------------------------------------------------


class UndecodableMessage(EventDecodeError):
    """A consumed message is not a CloudEvents 1.0 JSON event (structured
    mode): not JSON, not an object, without ``specversion``, ``id``,
    ``source`` or ``type``, or of another ``specversion`` (``"0.3"``); or the
    inbox cannot store one of the attributes
    it keeps (``id``, ``source``, ``type``, ``subject``, ``aggregatetype``:
    not a string, holding a NUL character, or longer than its column; an id
    is never truncated). ``manage.py consume`` dead-letters it (one inbox row per
    consumer of its queue, with the body and this error, keyed by the body's
    SHA-256 when its own id and source are unusable), acknowledges it and
    goes on: it never blocks the queue. An :class:`EventDecodeError` that no
    retry can help: the message's bytes never change."""


class UnsupportedDatabase(OutboxError, ImproperlyConfigured):
    """The outbox's database is none of PostgreSQL, MySQL/MariaDB and SQLite
    (``connection.vendor``): outbox_app has no SQL for it."""


class RelayAlreadyRunning(OutboxError):
    """A second relay started against a SQLite database that already has one.

    SQLite has no ``SELECT ... FOR UPDATE SKIP LOCKED``; one relay process per
    database file is the supported shape.
    """


class UnknownSubscriber(OutboxError, LookupError):
    """A subscriber name matches no registered handler or configured publisher."""


class UnknownTransition(OutboxError, ValueError):
    """A name that is not one of the operator's transitions of a delivery
    (``requeue``, ``retry_now``, ``dead_letter``, ``skip``: the operator's rows
    of :data:`outbox_app.store.lifecycle.DELIVERY`)."""


class SubscriptionInUse(OutboxError):
    """Retiring a subscription a running relay (or ``consume`` process) may
    still have: something refreshed the row within ``SERVED_SECONDS``, five
    minutes (a running process does every minute; ``outbox_subscribers
    --record`` does too), and its subscriber would silently stop receiving
    new events. Retire it once the code without it is deployed everywhere, or
    pass ``force`` (``--force``).

    Args:
        process: what refreshes such rows while it runs (``"relay"``,
            ``"consume process"``).
        refreshed: ``(subscription, seconds ago, by whom)`` of each row, as
            the message names them: who refreshed it and when, whichever
            command it was.
        minutes: how long after a refresh a row counts as in use.
    """

    def __init__(
        self, process: str, refreshed: Sequence[tuple[str, float, str]], minutes: int
    ):
        listing = "; ".join(
            f"{what} was refreshed {max(seconds, 0):.0f} s ago by {by or '?'}"
            for what, seconds, by in refreshed
        )
        super().__init__(
            f"{listing}. Until nothing refreshed it for {minutes} minutes it "
            f"counts as in use (a running {process} refreshes it every minute): "
            f"retire it once no {process} has it (or force it)"
        )


# --- operating --------------------------------------------------------------------


class HealthFileUnreadable(OutboxError):
    """A health file (``relay`` / ``consume`` ``--health-file``) read by
    ``manage.py outbox_health`` is missing (the process has not turned its
    loop yet, or stopped cleanly and removed it), cannot be read, or is not
    the JSON object ``{"alive_at": ..., "ready": ..., "why": ...}``. The
    command exits 1 with this message: the probe fails."""


# --- testing (outbox_app.testing) -------------------------------------------------


class PublishedMismatch(OutboxError, AssertionError):
    """An assertion of :mod:`outbox_app.testing` on what a block published
    failed (``assert_published``, ``assert_published_once``,
    ``assert_not_published``), or names a field the event does not have. The
    message lists every event published, the rolled-back ones marked. An
    ``AssertionError``, so test runners report it as a failed assertion."""


class HandlerFailed(OutboxError):
    """``deliver_now()`` (:mod:`outbox_app.testing`) sent a delivery to the
    dead letter: a handler (or an ``on_commit`` callback it registered) raised
    on its last attempt, or raised an error it never retries. The message
    lists each such delivery with its error; the first one's exception is the
    ``__cause__``; ``report`` is the whole
    :class:`~outbox_app.testing.DeliveryReport`
    (``deliver_now(raise_errors=False)`` returns it instead)."""

    def __init__(self, message: str, report):
        super().__init__(message)
        self.report = report


class EndlessDelivery(OutboxError):
    """``deliver_now()`` (:mod:`outbox_app.testing`) delivered events whose
    handlers published new events, whose handlers published more, for 100
    rounds: a cycle (a handler that publishes the event it handles, or two
    that publish each other's). The message lists the last round's events."""


# --- upgrading --------------------------------------------------------------------


class OutboxDeprecationWarning(OutboxError, DeprecationWarning):
    """A name renamed in this release was used: a setting (``OUTBOX_*``, also
    reported by ``manage.py check`` as ``outbox.W010``), an exception or a
    module's constant. The old name still works, reading the new one, until
    the next release; docs/operations.md ("Upgrading") lists the renames."""


def renamed(module: str, names: dict[str, str]):
    """A module's ``__getattr__`` that keeps ``names`` (old name -> new
    name, both of ``module``) working for one release: reading an old name
    gives the new one's value and warns
    (:class:`OutboxDeprecationWarning`).

    Raises:
        AttributeError: (from the returned function) any other missing name.
    """

    def __getattr__(name: str) -> Any:
        import sys

        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is renamed {new}; the old name goes in the next release",
            OutboxDeprecationWarning,
            stacklevel=2,
        )
        return getattr(sys.modules[module], new)

    return __getattr__


__getattr__ = renamed(__name__, {"HandlerTimeout": "CallTimeout"})
