"""``publish()``: append events to the outbox in the caller's transaction.

The rows commit with the caller's ORM writes or not at all. Nothing is sent from
here: after the commit, and only then, one wake-up per transaction is signalled
(``transaction.on_commit(..., robust=True)``) so a relay can start at once; the
relay's own polling is what guarantees delivery.

This module loads no model when imported (the outbox model is imported
where it is used), so ``publish``, ``acting``, ``outbox_action`` and
``events_committed`` import before Django's app registry is ready.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import django.dispatch
from django.db import IntegrityError, connections, models, router, transaction
from django.db.models.base import ModelState
from django.utils import timezone

from ..conf import outbox_settings
from ..events.codec import encode, to_json
from ..events.ids import new_event_id
from ..events.text import require_storable
from ..events.types import Event, validate_event_type
from ..exceptions import (
    DuplicateAggregateVersion,
    DuplicateOutboxEvent,
    InvalidEvent,
    InvalidPayload,
    InvalidSchedule,
    OutboxRequiresActiveTransaction,
)
from ..execution import tracing
from ..store.clock import database_now
from ..store.gateway import streaming
from ..store.sql import PRIMARY_KEY, dialect

if TYPE_CHECKING:
    from ..store.models import OutboxEvent

logger = logging.getLogger("outbox_app.publishing.outbox")

#: Sent once per committed transaction that published events, after the commit.
#: Arguments: ``sender=OutboxEvent``, ``using`` (database alias). The relay and
#: the PostgreSQL/Celery wake-ups listen to it.
events_committed = django.dispatch.Signal()
#: Sent by ``publish()`` (and every write that publishes: tracked models,
#: aggregates, ``enqueue()``) right after its INSERT, inside the caller's
#: transaction, which may still roll back. Arguments: ``sender=OutboxEvent``,
#: ``rows`` (the :class:`OutboxEvent` rows written, in publish order),
#: ``using`` (database alias). ``outbox_app.testing``'s captures listen to it.
events_written = django.dispatch.Signal()
#: Sent by every write that publishes right before its INSERT, inside the
#: caller's transaction. Arguments: ``sender=OutboxEvent``, ``using``
#: (database alias). The app records there the subscribers this process
#: knows of that have no cursor yet, so they receive the events it writes.
events_writing = django.dispatch.Signal()

Aggregate = models.Model | tuple[str, Any] | None


@dataclass
class _Action:
    id: uuid.UUID
    name: str
    params: dict[str, Any]
    #: Savepoint depth of each alias when the block began.
    depth: dict[str, int] = field(default_factory=dict)
    #: Aliases written to -> whether a write may have been rolled back since
    #: (it ran in a savepoint the block opened, which may have been undone).
    published: dict[str, bool] = field(default_factory=dict)

    def record(self, alias: str) -> None:
        """A publish() of this action wrote to ``alias``."""
        depth = len(transaction.get_connection(alias).savepoint_ids)
        nested = depth > self.depth.setdefault(alias, depth)
        self.published[alias] = self.published.get(alias, False) or nested

    def wrote(self) -> bool:
        """Whether a row of this action is still in its transaction: known
        without a query unless a write ran in a savepoint the block opened."""
        from ..store.models import OutboxEvent

        for alias, nested in self.published.items():
            if not nested:
                return True
            if OutboxEvent.objects.using(alias).filter(action_id=self.id).exists():
                return True
        return False


_current_action: contextvars.ContextVar[_Action | None] = contextvars.ContextVar(
    "outbox_action", default=None
)
#: The headers acting() adds to every event published in its block.
_acting: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar(
    "outbox_acting", default=None
)


@contextmanager
def acting(actor: Any = None, **metadata: Any) -> Iterator[None]:
    """Every event published in the block carries ``actor`` and ``metadata``
    in its headers (``{"actor": ..., "metadata": {...}}``): who did it and
    from where. Blocks nest: an inner ``actor``
    replaces the outer one, ``metadata`` is merged. Headers given to
    ``publish()`` win over these. ``outbox_app.middleware.ActingMiddleware``
    opens one per request; a Celery task or a management command opens its
    own::

        with acting("nightly-import", source="erp.csv"):
            Product.objects.create(...)

    Args:
        actor: any JSON value naming who acts (a user id, a service name).
        **metadata: JSON values describing the context (request path, ...).
    """
    outer = _acting.get() or {}
    inner = {
        "actor": actor if actor is not None else outer.get("actor"),
        "metadata": {**outer.get("metadata", {}), **metadata},
    }
    token = _acting.set({k: v for k, v in inner.items() if v not in (None, {})})
    try:
        yield
    finally:
        _acting.reset(token)


def publish(
    *events: Event | Mapping[str, Any],
    aggregate: Aggregate = None,
    aggregate_version: int | None = None,
    headers: Mapping[str, Any] | None = None,
    tenant_id: str | None = None,
    using: str | list[str] | tuple[str, ...] | None = None,
    deliver_at: datetime.datetime | datetime.timedelta | None = None,
    expires_at: datetime.datetime | datetime.timedelta | None = None,
    operation: str | None = None,
) -> list[OutboxEvent]:
    """Append ``events`` to the outbox inside the current transaction.

    With several database aliases (``using=["default", "shard2"]``, one
    outbox per shard) the same events, under the same ids, are written to
    each alias's outbox in that alias's own transaction: each shard's relay
    delivers its copy. That is NOT atomic across the aliases: the
    transactions commit one after the other, so a failure between two
    commits leaves the events on the aliases that committed and not on the
    others (publish them there again with the same ids: event mappings with
    ``"id"``).

    Args:
        *events: :class:`~outbox_app.Event` dataclass instances, or mappings
            ``{"event_type": str, "payload": dict, "revision": int}``.
        aggregate: the model instance the events are about (its label and pk
            become ``aggregate_type``/``aggregate_id``, its database the default
            for ``using``), or an ``(aggregate_type, aggregate_id)`` pair.
        aggregate_version: version of the aggregate for the first event; the
            following events of this call get the next versions. Unique per
            aggregate.
        headers: JSON-serialisable envelope data (correlation id, causation id,
            actor, ...), stored with every event of the call.
        tenant_id: the tenant the events belong to (``None``: no tenant).
        using: database alias; defaults to the aggregate's, else the router's.
            A list or tuple of distinct aliases writes the events to each
            (the aggregate's database is then not consulted).
        deliver_at: schedule the events: no delivery before this aware datetime
            (or this long from now, a timedelta). A time already past means at
            once. Relays deliver it within a poll interval after it
            (docs/publishing.md, "Scheduled and expiring events").
        expires_at: deliver the events by this aware datetime (or within this
            long from now) or not at all: a delivery still waiting then is
            SKIPPED with the error type ``EventExpired``.
            "Now", for a timedelta and for what is past, is the database's
            clock (:func:`~outbox_app.store.clock.database_now`), which the
            relays compare these times with, not this host's; with several
            aliases, each one's. The rows' ``occurred_at`` and
            ``created_at`` are stamped by it too.
        operation: what happened to the aggregate, a field of the envelope
            (CloudEvents ``operation``, routing key ``{operation}``); tracked
            models (:func:`outbox_app.track`) set ``create``, ``update``,
            ``delete`` or ``soft_delete``. At most 32 characters.

    Returns:
        The created :class:`OutboxEvent` rows, in argument order, written with ONE
        INSERT statement per alias; with several aliases, each alias's rows
        in turn, in the order of ``using`` (``row._state.db`` names it).

    Raises:
        OutboxRequiresActiveTransaction: not inside ``transaction.atomic`` on the
            alias (on every alias of a list). Nothing is written.
        InvalidEventType, InvalidPayload, PayloadTooLarge, InvalidSchedule: bad
            input, checked before the INSERT. Nothing is written.
        InvalidEvent: ``using`` an empty list or tuple, or one naming an
            alias twice or holding a non-string;
            an event mapping with a key other than ``event_type``,
            ``payload``, ``revision`` and ``id`` (a typo: ``paylod``); an
            ``aggregate_version`` that is not an integer; an ``operation``
            that is not a string of 1 to 32 characters; an aggregate type or
            id, a ``tenant_id`` or an ``operation`` holding a NUL character
            or a lone surrogate, or longer than its column (150, 255, 255
            characters): no database stores them alike. Nothing is written.
        DuplicateAggregateVersion: the aggregate already has one of these versions.
        DuplicateOutboxEvent: an event id already exists.
        django.db.DatabaseError: any other database error, unchanged. As with any
            ORM write, a database error leaves the transaction to roll back;
            wrap ``publish()`` in its own ``atomic()`` to catch one and go on.
    """
    aliases = _aliases(aggregate, using)
    for alias in aliases:
        _require_transaction(alias)
    if aggregate_version is not None and (
        not isinstance(aggregate_version, int) or isinstance(aggregate_version, bool)
    ):
        raise InvalidEvent(
            f"aggregate_version must be an integer or None, got "
            f"{aggregate_version!r}; nothing was written"
        )
    # By the database's clock, not this host's (which may be minutes off): the
    # rows' stamps, and "from now" of each alias's schedule.
    now = database_now(aliases[0], writer=True)
    schedules = [_schedule(deliver_at, expires_at, now)] + [
        _schedule(deliver_at, expires_at, database_now(alias, writer=True))
        for alias in aliases[1:]
    ]
    extras = dict(schedules[0])
    if operation is not None:
        if not isinstance(operation, str) or not operation:
            raise InvalidEvent(
                f"operation must be a string of 1 to 32 characters, got "
                f"{operation!r}; nothing was written"
            )
        extras["operation"] = require_storable(operation, "operation", 32)
    with tracing.creating(headers) as span:
        rows, texts = _rows(
            events, aggregate, aggregate_version, headers, tenant_id, extras, now
        )
        _write(rows, texts, aliases[0], span)
        written = list(rows)
        for alias, schedule in zip(aliases[1:], schedules[1:], strict=True):
            # A row knows its one database: each alias gets rows of its own,
            # holding the same values (so ``texts`` still holds their JSON)
            # but the schedule counted from its own clock.
            fields = _unset()[1]
            copies = [
                _row({**{f: getattr(row, f) for f in fields}, **schedule})
                for row in rows
            ]
            _write(copies, texts, alias)
            written += copies
    return written


def publish_each(
    items: Sequence[tuple[Event | Mapping[str, Any], Aggregate]],
    *,
    operation: str,
    using: str,
) -> list[OutboxEvent]:
    """``publish()`` of one event per aggregate, all with ONE INSERT: what a
    tracked model's bulk write publishes (``outbox_app.publishing.tracking``).

    Args:
        items: ``(event, aggregate)`` pairs, as ``publish()`` takes them.
        operation: the envelope's operation of every event.
        using: the database alias of the write.

    Raises:
        As :func:`publish`.
    """
    _require_transaction(using)
    rows: list[OutboxEvent] = []
    texts: dict[int, str] = {}
    now = database_now(using, writer=True)
    with tracing.creating(None) as span:
        for event, aggregate in items:
            more, more_texts = _rows(
                [event], aggregate, None, None, None, {"operation": operation}, now
            )
            rows += more
            texts.update(more_texts)
        _write(rows, texts, using, span)
    return rows


def _write(
    rows: list[OutboxEvent], texts: dict[int, str], alias: str, span: Any = None
) -> None:
    """INSERT ``rows`` (stamped with the current action), then wake the relays
    on commit. ``span``: the publishing call's span
    (:func:`~outbox_app.execution.tracing.creating`), named by the rows."""
    if not rows:
        return
    if span is not None:
        tracing.created(span, [(row.event_type, row.id) for row in rows])
    action = _current_action.get()
    if action is not None:
        for row in rows:
            row.action_id, row.action_name = action.id, action.name
            row.action_params = action.params
    events_writing.send(sender=type(rows[0]), using=alias)
    _insert(rows, alias, texts)
    if action is not None:
        action.record(alias)  # only once the rows are written
    events_written.send(sender=type(rows[0]), rows=rows, using=alias)
    _wake_on_commit(alias)


@contextmanager
def outbox_action(
    name: str, params: Mapping[str, Any] | None = None, *, using: str | None = None
) -> Iterator[uuid.UUID]:
    """Stamp every event published inside the block with one action id.

    An action groups everything one unit of work published. An action that
    publishes nothing still leaves one sentinel row (NULL ``event_type`` and
    ``payload``) so its run is recorded; the relay never delivers sentinels.
    Use it inside ``transaction.atomic``::

        with transaction.atomic(), outbox_action("WalletDeposit", {"amount": 10}):
            ...

    Yields:
        The action id (UUIDv7).

    Raises:
        OutboxRequiresActiveTransaction: at the end of a block that published
            nothing, outside ``transaction.atomic`` on ``using``.
        InvalidPayload: ``params`` is not JSON-serialisable.
    """
    from ..store.models import OutboxEvent

    validate_event_type(name)
    params_json, _ = to_json(
        dict(params or {}), name, outbox_settings.MAX_PAYLOAD_BYTES
    )
    action = _Action(id=new_event_id(), name=name, params=params_json)
    alias = using or router.db_for_write(OutboxEvent)
    action.depth[alias] = len(transaction.get_connection(alias).savepoint_ids)
    token = _current_action.set(action)
    try:
        yield action.id
    finally:
        _current_action.reset(token)
    # Only reached when the block did not raise. A publish() that failed (and
    # was caught), or whose savepoint was rolled back, wrote nothing: the
    # action still leaves its sentinel.
    if not action.wrote():
        _require_transaction(alias)
        now = database_now(alias, writer=True)
        sentinel = OutboxEvent(
            namespace=outbox_settings.NAMESPACE,
            action_id=action.id,
            action_name=action.name,
            action_params=action.params,
            occurred_at=now,
            created_at=now,
            payload_bytes=0,
        )
        _insert([sentinel], alias)


def _aliases(
    aggregate: Aggregate, using: str | list[str] | tuple[str, ...] | None
) -> list[str]:
    """The aliases one publish() writes to: ``using`` as a list, or the one
    alias :func:`_alias` picks.

    Raises:
        InvalidEvent: an empty list or tuple, an alias twice, a non-string.
    """
    if not isinstance(using, list | tuple):
        return [_alias(aggregate, using)]
    if not using or not all(isinstance(alias, str) and alias for alias in using):
        raise InvalidEvent(
            f"using must be a database alias or a list of them, got {using!r}; "
            "nothing was written"
        )
    if len(set(using)) != len(using):
        raise InvalidEvent(
            f"using names an alias twice: {list(using)!r}; an event is written "
            "once per database; nothing was written"
        )
    return list(using)


def _alias(aggregate: Aggregate, using: str | None) -> str:
    if using:
        return using
    if isinstance(aggregate, models.Model) and aggregate._state.db:
        return aggregate._state.db
    from ..store.models import OutboxEvent

    return router.db_for_write(OutboxEvent)


def _require_transaction(alias: str) -> None:
    if not transaction.get_connection(alias).in_atomic_block:
        raise OutboxRequiresActiveTransaction(
            f"publish() must run inside transaction.atomic(using={alias!r}) so the "
            "events commit with your changes; nothing was written."
        )


def _aggregate_key(aggregate: Aggregate) -> tuple[str | None, str | None]:
    if aggregate is None:
        return None, None
    if isinstance(aggregate, models.Model):
        if aggregate.pk is None:
            raise InvalidEvent(
                f"aggregate {aggregate!r} has no primary key yet: save it first"
            )
        key = aggregate._meta.label, str(aggregate.pk)
    elif isinstance(aggregate, tuple) and len(aggregate) == 2:
        key = str(aggregate[0]), str(aggregate[1])
    else:
        raise InvalidEvent(
            "aggregate must be a model instance or an (aggregate_type, "
            f"aggregate_id) pair, got {aggregate!r}"
        )
    return (
        require_storable(key[0], "aggregate_type", _max_length("aggregate_type")),
        require_storable(key[1], "aggregate_id", _max_length("aggregate_id")),
    )


@functools.cache
def _max_length(name: str) -> int:
    """The ``max_length`` of the outbox's column ``name``."""
    from ..store.models import OutboxEvent

    return OutboxEvent._meta.get_field(name).max_length


def _schedule(
    deliver_at, expires_at, now: datetime.datetime
) -> dict[str, datetime.datetime | None]:
    """``deliver_at`` and ``expires_at`` as aware datetimes or None, a
    timedelta counted from ``now`` (the database's clock): a deliver_at
    already past by it is None (at once).

    Raises:
        InvalidSchedule: not an aware datetime nor a timedelta; expiring at
            or before it is due, or at or before ``now``.
    """
    if deliver_at is None and expires_at is None:
        return {}
    times = {}
    for name, value in (("deliver_at", deliver_at), ("expires_at", expires_at)):
        if isinstance(value, datetime.timedelta):
            value = now + value
        elif isinstance(value, datetime.datetime):
            if timezone.is_naive(value):
                raise InvalidSchedule(
                    f"{name} must be an aware datetime (timezone.now() + ...), got "
                    f"the naive {value.isoformat()}; nothing was written"
                )
        elif value is not None:
            raise InvalidSchedule(
                f"{name} must be a datetime, a timedelta or None, got "
                f"{type(value).__name__}; nothing was written"
            )
        times[name] = value
    due = times["deliver_at"]
    if due is not None and due <= now:
        times["deliver_at"] = due = None
    expiry = times["expires_at"]
    if expiry is not None and expiry <= (due or now):
        raise InvalidSchedule(
            f"expires_at {expiry.isoformat()} is not after "
            + (f"deliver_at {due.isoformat()}" if due else "now")
            + ": the event could never be delivered; nothing was written"
        )
    return times


def _rows(events, aggregate, aggregate_version, headers, tenant_id, extras, now):
    """The rows of one publish(), stamped ``now``, and, by ``id()`` of each
    JSON value, the JSON text that stores it (encoded once, when it was
    validated)."""
    aggregate_type, aggregate_id = _aggregate_key(aggregate)
    if isinstance(tenant_id, str):
        require_storable(tenant_id, "tenant_id", _max_length("tenant_id"))
    max_bytes = outbox_settings.MAX_PAYLOAD_BYTES
    if headers is not None and not isinstance(headers, Mapping):
        raise InvalidPayload(
            f"headers must be a mapping, got {type(headers).__name__}", field="headers"
        )
    context = _acting.get()
    if context:
        headers = {**context, **(headers or {})}
    headers = tracing.inject(headers)
    envelope, envelope_text = to_json(dict(headers or {}), "headers", max_bytes)
    texts = {id(envelope): envelope_text}
    namespace = outbox_settings.NAMESPACE
    rows = []
    for position, event in enumerate(events):
        encoded = encode(event, max_bytes)
        texts[id(encoded.payload)] = encoded.payload_text
        values = {
            "id": encoded.id or new_event_id(),
            "namespace": namespace,
            "event_type": encoded.event_type,
            "revision": encoded.revision,
            "aggregate_type": aggregate_type,
            "aggregate_id": aggregate_id,
            "aggregate_version": (
                None if aggregate_version is None else aggregate_version + position
            ),
            "payload": encoded.payload,
            "payload_bytes": _utf8_bytes(encoded.payload_text),
            "headers": envelope,
            "tenant_id": tenant_id,
            "occurred_at": now,
            "created_at": now,
            **extras,
        }
        rows.append(_row(values))
    return rows, texts


def _utf8_bytes(text: str) -> int:
    """``len(text.encode())``, without encoding ASCII text."""
    return len(text) if text.isascii() else len(text.encode())


def _insert(
    rows: list[OutboxEvent], alias: str, texts: dict[int, str] | None = None
) -> None:
    """Write ``rows`` with one multi-row ``INSERT ... VALUES``; the database
    numbers their ``position`` in the order of ``rows``.

    The ORM's ``bulk_create`` spends most of a publish in the SQL compiler (per
    row, per field) and, on PostgreSQL, sends the rows as ``UNNEST`` arrays that
    psycopg escapes in Python. Here the statement is built once per (database,
    row count) and each value goes through its field's ``get_db_prep_save``,
    once per distinct object: the rows of one call share their envelope,
    aggregate and timestamps. A JSON value whose text ``texts`` holds (by
    ``id()``) is sent as that text, not encoded a second time; a None is sent
    as it is.
    """
    connection = connections[alias]
    texts = texts or {}
    prepared: dict[tuple[str, int], Any] = {}
    params: list[Any] = []
    # Outside an action its three columns are NULL, and so are the schedule's
    # and the operation on most events: left out of the statement (fewer
    # parameters to bind: psycopg caches a query's parsing only up to 50
    # parameters).
    action = any(row.action_id is not None for row in rows)
    first = rows[0]
    extra = any(getattr(first, name) is not None for name in _EXTRA_FIELDS)
    columns = _columns(alias, action, extra)
    # Stream delivery reads the event as it is written, never writes it again
    # (fanned_out NULL); row delivery fans it out (False until it has).
    stream = streaming(alias)
    for row in rows:
        row.fanned_out = None if stream else False
    for row in rows:
        for f, plain in columns:
            value = getattr(row, f.attname)
            if value is None or plain:
                params.append(value)
                continue
            key = (f.attname, id(value))
            if key not in prepared:
                text = texts.get(id(value))
                prepared[key] = (
                    f.get_db_prep_save(value, connection) if text is None else text
                )
            params.append(prepared[key])
    try:
        with connection.cursor() as cursor:
            cursor.execute(_insert_sql(alias, len(rows), action, extra, stream), params)
    except IntegrityError as exc:
        from ..store.models import AGGREGATE_VERSION_UNIQUE, OutboxEvent

        violated = dialect(alias).violated_constraint(exc, OutboxEvent)
        if violated == AGGREGATE_VERSION_UNIQUE:
            raise DuplicateAggregateVersion(
                f"aggregate {rows[0].aggregate_type}:{rows[0].aggregate_id} already "
                f"has an event with one of the versions {rows[0].aggregate_version}"
                f"..{rows[-1].aggregate_version}: {exc}"
            ) from exc
        if violated == PRIMARY_KEY:
            raise DuplicateOutboxEvent(
                f"an outbox event id already exists: {exc}"
            ) from exc
        raise
    for row in rows:
        row._state.adding, row._state.db = False, alias


@functools.cache
def _unset() -> tuple[type[OutboxEvent], dict[str, None]]:
    """The outbox model, and every field of its table, None unless given."""
    from ..store.models import OutboxEvent

    return OutboxEvent, dict.fromkeys(
        f.attname for f in OutboxEvent._meta.concrete_fields
    )


def _row(values: dict[str, Any]) -> OutboxEvent:
    """An unsaved OutboxEvent holding ``values`` (every other field None).

    Built as ``Model.__init__`` would build it, minus the work that does not
    apply here (defaults, descriptors, keyword checks, the ``pre_init`` and
    ``post_init`` signals): ``__init__`` was a third of a ``publish()``'s
    Python time (docs/performance.md, "Publish overhead").
    """
    model, unset = _unset()
    row = model.__new__(model)
    row.__dict__.update(unset, **values)
    row._state = ModelState()
    return row


#: Columns an event outside an action leaves NULL.
_ACTION_FIELDS = ("action_id", "action_name", "action_params")
#: Columns an event with no schedule and no operation leaves NULL (one
#: publish() call's events share them).
_EXTRA_FIELDS = ("deliver_at", "expires_at", "operation")


@functools.cache
def _columns(
    alias: str, action: bool, extra: bool
) -> tuple[tuple[models.Field, bool], ...]:
    """The fields an INSERT writes (the action's only with ``action``, the
    schedule's and the operation only with ``extra``) and
    whether their values cross the DB-API as they are (text, numbers,
    booleans: ``get_db_prep_save`` would return them unchanged), per
    database. ``position`` and ``txid`` are not among them: the database
    fills them; nor is ``sequence``, a relay's (MySQL/MariaDB), or
    ``fanned_out``, a literal of the statement."""
    from ..store.models import OutboxEvent

    native_uuid = connections[alias].features.has_native_uuid_field
    return tuple(
        (
            f,
            isinstance(f, models.CharField | models.IntegerField | models.BooleanField)
            or (isinstance(f, models.UUIDField) and native_uuid),
        )
        for f in OutboxEvent._meta.concrete_fields
        if f.attname not in ("position", "txid", "sequence", "fanned_out")
        and (action or f.attname not in _ACTION_FIELDS)
        and (extra or f.attname not in _EXTRA_FIELDS)
    )


@functools.cache
def _insert_sql(alias: str, count: int, action: bool, extra: bool, stream: bool) -> str:
    """``INSERT INTO <outbox> (<columns>) VALUES (...) x count``, cached;
    positions in the statement where the database wants them there
    (:meth:`~outbox_app.store.sql.base.Dialect.positions`); ``fanned_out``
    NULL for stream delivery (``stream``), FALSE for row delivery."""
    from ..store.models import OutboxEvent

    quote = connections[alias].ops.quote_name
    table = quote(OutboxEvent._meta.db_table)
    names = [quote(f.column) for f, _ in _columns(alias, action, extra)]
    values = ["%s"] * len(names)
    names.append(quote("fanned_out"))
    values.append("NULL" if stream else "FALSE")
    positions = dialect(alias).positions(table, count)
    if positions is None:
        rows = [values] * count
    else:
        names.append(quote("position"))
        rows = [[*values, position] for position in positions]
    return (
        f"INSERT INTO {table} ({', '.join(names)}) "
        f"VALUES {', '.join('(' + ', '.join(row) + ')' for row in rows)}"
    )


_wakers: dict[str, Any] = {}


def _wake_on_commit(alias: str) -> None:
    """Register the wake-up once per transaction, however many publishes it has.

    A rolled-back savepoint takes its callbacks with it (Django's documented
    ``on_commit`` behaviour), so a later publish in the same transaction
    registers a new one.
    """
    waker = _wakers.get(alias)
    if waker is None:
        waker = _wakers.setdefault(alias, _Waker(alias))
    connection = transaction.get_connection(alias)
    if any(func is waker for _, func, _ in connection.run_on_commit):
        return
    transaction.on_commit(waker, using=alias, robust=True)


class _Waker:
    def __init__(self, alias: str):
        self.alias = alias
        self.__qualname__ = f"outbox wake-up ({alias})"

    def __call__(self) -> None:
        from ..store.models import OutboxEvent

        for receiver, result in events_committed.send_robust(
            sender=OutboxEvent, using=self.alias
        ):
            if isinstance(result, Exception):
                logger.error(
                    "outbox wake-up receiver %r failed: %s",
                    receiver,
                    result,
                    exc_info=result,
                )
