"""The statements every database shares, and the hooks where databases differ.

:class:`Dialect` builds the text of the relay's statements (fan-out, claim,
renew, outcomes), converts values across the DB-API, reads the drivers'
errors and shapes the schema's database-specific parts (partial indexes,
position numbering). Each database's subclass (``postgresql.py``,
``mysql.py``, ``sqlite.py``) sets its flags and overrides what it does
differently; nothing outside this package asks which database it is on.

Texts are built once per process and database, each variant by list length
on first use, and kept (``functools.cache`` per instance).
"""

from __future__ import annotations

import datetime
import functools
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from django.conf import settings
from django.db import connections, models
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ...events.codec import loads
from ...subscribers import WILDCARD
from ..lifecycle import CLAIMABLE, UNFINISHED, State
from ..tables import Tables

#: A subscription (``s``) of an event of the batch (``b``): its type, or every type.
SUBSCRIBED = f"s.event_type = '{WILDCARD}' OR s.event_type = b.event_type"

#: What a claim sets on each row it takes. Parameters: the lease token, the
#: worker, the lease's expiry twice, now.
CLAIM_ASSIGN = (
    f"state = '{State.RUNNING}', attempts = attempts + 1, lease_token = %s, "
    "locked_by = %s, locked_until = %s, next_retry_at = %s, updated_at = %s"
)

#: What :meth:`Dialect.violated_constraint` returns for a primary key.
PRIMARY_KEY = "primary key"


def _literal(value: Any) -> str:
    """``value`` (a model field's default: text, a whole number or None) as
    an SQL literal. Raises TypeError for any other type."""
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    if isinstance(value, int):  # bool included
        return str(int(value))
    raise TypeError(f"no SQL literal for a default of type {type(value).__name__}")


def _states(states: Sequence[str]) -> str:
    """An SQL list of state names, in the order the partial indexes spell them
    (SQLite uses a partial index only for a condition written the same way)."""
    return ", ".join(f"'{state}'" for state in states)


class Dialect:
    """What outbox_app's own SQL needs to know about one database (alias
    ``alias``): its capabilities, the text of the relay's statements, how
    values cross the DB-API and how its driver reports errors. The
    statements name the tables and columns ``tables`` gives
    (:class:`~outbox_app.store.tables.Tables`): a dialect imports no model.

    Attributes (set by each database's subclass):
        vendor: ``connection.vendor``.
        update_returning: ``UPDATE ... RETURNING`` (PostgreSQL; SQLite 3.35+,
            whose RETURNING may hold scalar subqueries but not a join).
        writable_cte: data-modifying statements in ``WITH`` (PostgreSQL): a
            claim and its read, or a fan-out batch's lock, insert and flip,
            are one statement.
        array_parameter: one list parameter for ``= ANY(%s)`` (PostgreSQL);
            elsewhere a list is spelled ``IN (%s, %s, ...)``.
        probe_fence: appended to a correlated ``NOT EXISTS`` subquery so it
            runs as a probe per outer row, by index (PostgreSQL: ``OFFSET 0``
            keeps the planner from turning it into an anti-join, whose plan
            depends on statistics; see :meth:`_candidates`).
        clock_sql: a query of the database server's clock, UTC (PostgreSQL's
            ``clock_timestamp()``, the time it runs even inside a
            transaction; MySQL/MariaDB's ``UTC_TIMESTAMP(6)``); None for
            SQLite, an embedded database whose clock is the process's own.
        single_writer: one relay process per database (SQLite's file: one
            writer at a time, no row locks to skip).
        notifies: ``LISTEN``/``NOTIFY`` (PostgreSQL): a committed publish
            wakes relays in other processes at once; elsewhere they poll.
        insert_ignore: the words before and after an INSERT that skips rows
            breaking a unique constraint.
        stream: how stream delivery reads the outbox here: ``"snapshot"``
            (PostgreSQL: a batch is the events whose writing transaction is
            visible in one tick and was not in the previous one, in position
            order), ``"numbered"`` (MySQL/MariaDB, which have no snapshot
            functions: the relays number committed events in commit order,
            a tick is the last number given, and a batch is the events
            numbered after the previous tick and up to this one, in
            position order), ``"position"`` (SQLite: one writer at a time
            numbers positions in commit order, so the last position read is
            exact).
        transaction_id_type, current_transaction_id: the column type of an
            event's writing transaction id and the SQL of its default
            (PostgreSQL: ``xid8``, ``pg_current_xact_id()``); None and
            ``NULL`` where stream delivery does not read it.
    """

    vendor: str = ""
    stream: str = ""
    transaction_id_type: str | None = None
    current_transaction_id = "NULL"
    update_returning = False
    writable_cte = False
    array_parameter = False
    probe_fence = ""
    clock_sql: str | None = None
    single_writer = False
    notifies = False
    insert_ignore = ("INSERT INTO", " ON CONFLICT DO NOTHING")

    def __init__(self, alias: str, tables: Tables):
        self.alias = alias
        self.tables = tables
        self.quote_char = connections[alias].ops.quote_name("x")[0]
        self.n = self.quote(tables.delivery)
        self.e = self.quote(tables.event)
        self.s = self.quote(tables.subscription)
        self.c = self.quote(tables.cursor)
        self.q = self.quote(tables.sequencer)
        self.claimable = _states(CLAIMABLE)
        self.unfinished = _states(UNFINISHED)
        # The partial index spells it NOT "fanned_out" (SQLite matches the text).
        self.awaiting_fanout = "NOT e.fanned_out"
        self.fail = (
            f"UPDATE {self.n} SET state = %s, last_error = %s, last_error_type = %s, "
            "last_traceback = %s, first_failed_at = COALESCE(first_failed_at, %s), "
            "next_retry_at = COALESCE(%s, next_retry_at), completed_at = %s, "
            "locked_until = NULL, lease_token = NULL, updated_at = %s "
            f"WHERE id = %s AND lease_token = %s AND state = '{State.RUNNING}'"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.alias!r}>"

    # --- capabilities Django's features name (read on first use: MySQL's need
    # --- the server's version, a connection)

    @functools.cached_property
    def skip_locked(self) -> bool:
        """``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MySQL 8,
        MariaDB 10.6+); SQLite serialises its writers instead."""
        return connections[self.alias].features.has_select_for_update_skip_locked

    @functools.cached_property
    def lock_of(self) -> bool:
        """``FOR UPDATE OF <table>`` (PostgreSQL, MySQL 8)."""
        return connections[self.alias].features.has_select_for_update_of

    @functools.cached_property
    def native_uuid(self) -> bool:
        """UUIDs cross as ``uuid.UUID``; elsewhere as 32 hex digits."""
        return connections[self.alias].features.has_native_uuid_field

    # --- values across the DB-API ------------------------------------------------

    def quote(self, name: str) -> str:
        return f"{self.quote_char}{name}{self.quote_char}"

    def in_list(self, column: str, count: int) -> str:
        """``column`` is one of a list of ``count`` parameters."""
        if self.array_parameter:
            return f"{column} = ANY(%s)"
        return f"{column} IN ({', '.join(['%s'] * count)})"

    def list_params(self, values: list) -> list:
        """The parameters :meth:`in_list` expects for ``values``."""
        return [list(values)] if self.array_parameter else list(values)

    def uuid_param(self, value: uuid.UUID | None) -> Any:
        if value is None or self.native_uuid:
            return value
        return value.hex

    def uuid_value(self, value: Any) -> uuid.UUID | None:
        if value is None or isinstance(value, uuid.UUID):
            return value
        return uuid.UUID(value)

    def datetime_param(self, value: datetime.datetime) -> Any:
        """As ``DateTimeField`` stores it (Django's own adaptation: aware on
        PostgreSQL, naive text in the connection's time zone elsewhere)."""
        return connections[self.alias].ops.adapt_datetimefield_value(value)

    def datetime_value(self, value: Any) -> datetime.datetime | None:
        """A datetime read back: aware in the connection's time zone, as
        ``DateTimeField`` reads it (SQLite returns expressions as text)."""
        return self.datetime_reader()(value)

    def datetime_reader(self) -> Callable[[Any], datetime.datetime | None]:
        """:meth:`datetime_value` with ``USE_TZ`` and the connection's time
        zone read once, for the rows of one read: per value they cost more
        than the conversion (a lazy setting, a thread's connection)."""
        zone = connections[self.alias].timezone if settings.USE_TZ else None

        def read(value: Any) -> datetime.datetime | None:
            if isinstance(value, str):
                value = parse_datetime(value)
            # The driver's aware values (PostgreSQL) are taken as they are.
            if value is not None and value.tzinfo is None and zone is not None:
                value = timezone.make_aware(value, zone)
            return value

        return read

    def cursor(self, connection):
        """A cursor of ``connection`` (Django's wrapper) for the relay's
        statements (:class:`~outbox_app.store.gateway.Gateway`)."""
        return connection.cursor()

    @staticmethod
    def json_value(value: Any) -> Any:
        """A JSON column's value: the drivers return its text (Django registers
        PostgreSQL's jsonb loader as text, as ``JSONField`` expects)."""
        if isinstance(value, bytes):
            value = value.decode()
        return loads(value) if isinstance(value, str) else value

    # --- publish's INSERT and the schema -------------------------------------------

    def positions(self, table: str, count: int) -> list[str] | None:
        """SQL for the ``position`` of each of ``count`` rows one INSERT
        writes into ``table`` (quoted), in order, where the INSERT is to give
        it; None where the database numbers them (see
        :meth:`position_numbering`)."""
        return None

    def position_numbering(self, table: str) -> list[str]:
        """The statements that have the database number the ``position`` of
        each row inserted into ``table`` (unquoted) without one (left out, or
        NULL) after every number given so far, whoever inserts it."""
        raise NotImplementedError

    def update_from(self, table: str, source: str, on: str, columns) -> str:
        """``UPDATE table t`` setting each of ``columns`` to the same column of
        the rows of ``source`` (aliased ``o``) matched by ``on``: ``UPDATE ...
        FROM`` (PostgreSQL, SQLite 3.33+)."""
        assign = ", ".join(f"{c} = o.{c}" for c in columns)
        return f"UPDATE {table} AS t SET {assign} FROM {source} AS o WHERE {on}"

    def json_bytes(self, column: str) -> str:
        """SQL for the length in bytes of the JSON text stored in ``column``
        (0 for NULL)."""
        return f"COALESCE(length(CAST({column} AS BLOB)), 0)"

    def filtered_index(self, index) -> models.Index | None:
        """The index ``index`` (a ``store.db.FilteredIndex``: ``fields``,
        ``name``, ``when``, ``fallback_prefix``) creates here: a partial
        index (PostgreSQL, SQLite)."""
        return models.Index(fields=index.fields, name=index.name, condition=index.when)

    #: A statement that does nothing: what a schema change writes for an index
    #: this database does not keep (:meth:`filtered_index` returns None).
    no_op = "SELECT 1"

    def rename_index(self, table: str, old: str, new: str) -> str | None:
        """SQL renaming index (or unique constraint) ``old`` of ``table`` (both
        unquoted) to ``new``, or None where the name lives only in the
        table's SQL (SQLite: the table is rebuilt)."""
        return None

    # --- the driver's errors -----------------------------------------------------

    def violated_constraint(
        self, error: Exception, model: type[models.Model]
    ) -> str | None:
        """The unique constraint of ``model`` that ``error`` (an
        ``IntegrityError`` from an INSERT into its table) reports: the name of
        one of its ``Meta.constraints``, :data:`PRIMARY_KEY`, or None for
        anything else (a constraint or index of the project's own, a NOT NULL,
        a check).

        Read from what the driver says of the constraint, never from words of
        the message a value could contain."""
        raise NotImplementedError

    @staticmethod
    def _unique(model: type[models.Model]) -> dict[str, tuple[str, ...]]:
        """The columns of each named unique constraint of ``model``."""
        return {
            c.name: tuple(model._meta.get_field(f).column for f in c.fields)
            for c in model._meta.constraints
            if isinstance(c, models.UniqueConstraint) and c.fields
        }

    #: Statements that read the connection's wait for a lock another
    #: transaction holds (one value) and set it (one parameter: the value
    #: read, or :attr:`no_lock_wait`), which
    #: :func:`~outbox_app.store.db.unless_waiting` sets back; None where
    #: writers never wait on each other's rows.
    lock_wait: tuple[str, str] | None = None
    #: The shortest wait :attr:`lock_wait` sets.
    no_lock_wait: Any = None

    def gave_up_waiting(self, error: Exception) -> bool:
        """Whether ``error`` (a ``DatabaseError``) is a statement giving up
        its wait for a lock after :attr:`no_lock_wait` (only the statement
        is undone)."""
        return False

    def deadlocked(self, error: Exception) -> bool:
        """Whether the database broke a deadlock by rolling back the
        transaction that raised ``error`` (a ``DatabaseError``). Such a victim
        is meant to run again."""
        return False

    def transaction_aborted(self, connection) -> bool:
        """Whether the database aborted ``connection``'s (a Django connection)
        open transaction after an error that was caught with no savepoint
        around it, so that its COMMIT would roll back; read from the
        connection's state, no round trip. False where the database undoes
        the failed statement alone."""
        return False

    # --- the relay's statements --------------------------------------------------

    def _held(self, count: int) -> str:
        """Rows of an id list still held under a lease token (the fence every
        outcome passes)."""
        return (
            f"{self.in_list('id', count)} AND lease_token = %s "
            f"AND state = '{State.RUNNING}'"
        )

    def _read(self, where: str) -> str:
        """Claimed deliveries (``c``) with the event columns a delivery
        reads, in delivery id order."""
        columns = ", ".join(f"e.{c}" for c in self.tables.event_columns)
        return (
            f"SELECT c.id, c.attempts, c.subscriber, {columns} FROM {self.n} c "
            f"JOIN {self.e} e ON e.id = c.event_id WHERE {where} ORDER BY c.id"
        )

    # -- fan-out

    def _awaiting(self, type_count: int | None, paged: bool) -> list[str]:
        """The conditions of events (``e``) awaiting fan-out: of ``type_count``
        types (parameters; None: every type), after an id (a parameter) when
        ``paged``."""
        where = [self.awaiting_fanout, "e.event_type IS NOT NULL"]
        if type_count is not None:
            where.append(f"e.event_type IN ({', '.join(['%s'] * type_count)})")
        if paged:
            where.append("e.id > %s")
        return where

    def _batch(
        self, where: list[str], columns: Sequence[str], claiming: bool, lock: str
    ) -> str:
        """A fan-out batch: the first events of ``where`` in id order (a limit
        parameter), ``columns`` read, ``lock`` appended; when ``claiming``,
        only the first within the claim's budget."""
        select = (
            f"SELECT {', '.join(f'e.{c}' for c in columns)} FROM {self.e} e "
            f"WHERE {' AND '.join(where)} ORDER BY e.id LIMIT %s" + lock
        )
        if claiming:
            # What the claim may hold: the first events within its budget.
            select = self._within_budget(select, columns, "id")
        return select

    def _subscriptions(self, claiming: bool) -> str:
        """(name, event type or * for every type[, claimed 1/0]) per active
        subscription, read where the deliveries are written."""
        claimed = (
            ", CASE WHEN subscriber = %s THEN 1 ELSE 0 END AS claimed"
            if claiming
            else ""
        )
        return (
            f"SELECT subscriber AS name, event_type{claimed} FROM {self.s} "
            "WHERE retired_at IS NULL"
        )

    def _copied(self, e: str) -> dict[str, str]:
        """The event's (``e``) copied columns (:attr:`Tables.copied_columns
        <outbox_app.store.tables.Tables.copied_columns>`), by the delivery
        column each fills: ``id`` fills ``event_id``."""
        return {
            ("event_id" if name == "id" else name): f"{e}.{name}"
            for name in self.tables.copied_columns
        }

    def _with_defaults(self, row: dict[str, str]) -> tuple[str, str]:
        """``row`` (delivery column -> its value, as SQL) and every other
        column of the deliveries' table at its model field's default
        (:attr:`Tables.delivery_defaults
        <outbox_app.store.tables.Tables.delivery_defaults>`), as an INSERT
        spells them: ``(columns, values)``."""
        row = dict(row)
        for column, default in self.tables.delivery_defaults.items():
            if column not in row:
                row[column] = _literal(default)
        return ", ".join(row), ", ".join(row.values())

    def _delivery_row(self, claiming: bool) -> tuple[str, str]:
        """The columns fan-out inserts and their values, as SQL, for an event
        of the batch (``b``) and a subscription (``s``): ``(columns, values)``.

        The event's copied columns, the subscriber, the state and lease
        columns a claim sets (when ``claiming``: on the rows of the claiming
        relay's own subscriber, parameters the lease's time, holder and
        token), the due time and ``created_at``/``updated_at`` (parameters),
        and every other column at its model field's default: the model is
        the one home of a new delivery's defaults, here as in
        ``DeliveryQuerySet.create_for``.
        """
        # A scheduled event's rows are due at its deliver_at (publish() stores
        # only times still ahead), so the claim's index orders them by it; they
        # are never claimed here, as they are created.
        due = "COALESCE(b.deliver_at, %s)"
        row = self._copied("b")
        row["subscriber"] = "s.name"
        if claiming:
            mine = "CASE WHEN s.claimed = 1 AND b.deliver_at IS NULL THEN"
            row.update(
                state=f"{mine} '{State.RUNNING}' ELSE '{State.PENDING}' END",
                attempts=f"{mine} 1 ELSE 0 END",
                next_retry_at=f"{mine} %s ELSE {due} END",
                locked_until=f"{mine} %s END",
                locked_by=f"{mine} %s ELSE '' END",
                lease_token=f"{mine} %s END",
            )
        else:
            row["next_retry_at"] = due
        row.update(created_at="%s", updated_at="%s")
        return self._with_defaults(row)

    @functools.cache  # noqa: B019 (one instance per database, kept for the process)
    def fan_out(self, type_count: int | None, paged: bool, claiming: bool):
        """A fan-out step as statements of one transaction:
        ``(find, lock or None, insert(count), flip(count), read(count))``.

        Parameters: the find's; the lock's: the find's filters, the last id
        chosen and how many; the insert's values, subscriptions, ids; the
        flip's ids; the read's ids, name and token (see ``Gateway.fan_out``).
        """
        n, e = self.n, self.e
        where = self._awaiting(type_count, paged)
        lock = " FOR UPDATE SKIP LOCKED" if self.skip_locked else ""
        # MySQL/MariaDB read a row whole, off-page payload included, to lock
        # it (InnoDB's exclusive locking reads): a claiming batch is chosen
        # without locks, within its budget, and only those events are locked.
        lock_later = claiming and bool(lock)
        select = self._batch(
            where, self.tables.copied_columns, claiming, "" if lock_later else lock
        )
        pairs = self._subscriptions(claiming)
        columns, values = self._delivery_row(claiming)
        ignore_prefix, ignore_suffix = self.insert_ignore

        @functools.cache
        def insert(count: int) -> str:
            return (
                f"{ignore_prefix} {n} ({columns}) SELECT {values} FROM {e} b "
                f"JOIN ({pairs}) s ON {SUBSCRIBED} WHERE {self.in_list('b.id', count)} "
                f"ORDER BY b.id{ignore_suffix}"
            )

        @functools.cache
        def flip(count: int) -> str:
            # Only the events that have a delivery now: one whose every
            # subscription was retired before the insert read them keeps
            # waiting for fan-out.
            return (
                f"UPDATE {e} SET fanned_out = 1 WHERE {self.in_list('id', count)} "
                f"AND EXISTS (SELECT 1 FROM {n} x WHERE x.event_id = {e}.id)"
            )

        @functools.cache
        def read(count: int) -> str:
            return self._read(
                f"{self.in_list('c.event_id', count)} AND c.subscriber = %s "
                "AND c.lease_token = %s"
            )

        # The chosen events (up to the last one chosen, as many), locked,
        # skipping those another relay holds: the find's scan, bounded.
        locked = (
            f"SELECT e.id FROM {e} e WHERE {' AND '.join(where)} AND e.id <= %s "
            f"ORDER BY e.id LIMIT %s{lock}"
        )
        return select, locked if lock_later else None, insert, flip, read

    # -- claims

    def _within_budget(self, rows: str, columns: Sequence[str], order: str) -> str:
        """The first rows of ``rows`` (a SELECT of ``columns``, ``payload_bytes``
        and the columns of ``order``, locked where the database locks) in
        ``order`` whose payloads add up to at most a budget in bytes (the
        first parameter after ``rows``'s), and at least as many rows as the
        second one says (1: a payload over the budget goes alone; 0: none).
        The running sum is taken outside the locking SELECT (PostgreSQL
        refuses window functions beside ``FOR UPDATE``); the few rows locked
        past the budget are left as they were."""
        names = ", ".join(columns)
        return (
            f"SELECT {names} FROM (SELECT {names}, SUM(payload_bytes) OVER "
            f"(ORDER BY {order} ROWS UNBOUNDED PRECEDING) AS running, "
            f"ROW_NUMBER() OVER (ORDER BY {order}) AS n FROM ({rows}) k) w "
            "WHERE w.running <= %s OR w.n <= %s"
        )

    def _candidates(self, names: int, ordered: bool, types: int | None) -> str:
        """Due rows of a subscriber's names, in claim order, locked skipping the
        rows another relay holds: ``id, next_retry_at, payload_bytes``."""
        n, e = self.n, self.e
        where = [
            f"c.subscriber IN ({', '.join(['%s'] * names)})",
            f"c.state IN ({self.claimable})",
            "c.next_retry_at <= %s",
        ]
        if ordered:
            # Publish order: positions are numbered by the database on insert,
            # so any two events of an aggregate compare (event ids come from
            # several hosts' clocks; versions may be missing).
            earlier = "{x}.position < c.position"
            # Each candidate, in claim order, is probed by index until the
            # batch is full (the fence). As anti-joins, PostgreSQL's plans
            # swung with the statistics: on never-analyzed tables a nested
            # loop rescanning every unfinished row per candidate (56 s per
            # claim at 7,780 rows), on analyzed ones 16x slower than the
            # probes at 100,000 rows (bench/RESULTS.md, "Ordered claims").
            fence = self.probe_fence
            where.append(
                f"NOT EXISTS (SELECT 1 FROM {n} u WHERE u.subscriber = c.subscriber "
                "AND u.aggregate_type = c.aggregate_type "
                "AND u.aggregate_id = c.aggregate_id "
                f"AND u.state IN ({self.unfinished}) "
                f"AND {earlier.format(x='u')}{fence})"
            )
            waiting = [
                self.awaiting_fanout,
                "e.event_type IS NOT NULL",
                "e.aggregate_type = c.aggregate_type",
                "e.aggregate_id = c.aggregate_id",
            ]
            if types is not None:
                waiting.append(f"e.event_type IN ({', '.join(['%s'] * types)})")
            where.append(
                f"NOT EXISTS (SELECT 1 FROM {e} e WHERE {' AND '.join(waiting)} "
                f"AND {earlier.format(x='e')}{fence})"
            )
        lock = ""
        if self.skip_locked:
            lock = (
                " FOR UPDATE OF c SKIP LOCKED"
                if self.lock_of
                else " FOR UPDATE SKIP LOCKED"
            )
        return (
            f"SELECT c.id, c.next_retry_at, c.payload_bytes FROM {n} c "
            f"WHERE {' AND '.join(where)} "
            f"ORDER BY c.next_retry_at, c.id LIMIT %s{lock}"
        )

    def claim_ids(self, names: int, ordered: bool, types: int | None) -> str:
        """The ids a claim takes: its candidates within the byte budget.
        Parameters: the candidates', then the budget in bytes and 1."""
        return self._within_budget(
            self._candidates(names, ordered, types), ["id"], "next_retry_at, id"
        )

    def claim(self, names: int, ordered: bool, types: int | None):
        """The claim of up to a limit of due rows of ``names`` names (``ordered``:
        each aggregate's head only, ``types`` event types awaiting fan-out
        holding it back, None: every type): one statement, or the statements
        of one transaction, as each database's subclass says. Parameters: the
        lease's, then the candidates', then the byte budget and 1 (at least
        one row)."""
        raise NotImplementedError

    @functools.cache  # noqa: B019
    def mark(self, count: int) -> str:
        """Claim the rows of a list of ``count`` ids (:data:`CLAIM_ASSIGN`'s
        parameters, then the ids)."""
        return f"UPDATE {self.n} SET {CLAIM_ASSIGN} WHERE {self.in_list('id', count)}"

    @functools.cache  # noqa: B019
    def read_claimed(self, count: int) -> str:
        """Read what delivering the claimed rows of a list of ``count`` ids needs."""
        return self._read(self.in_list("c.id", count))

    # -- outcomes

    @functools.cache  # noqa: B019
    def renew(self, count: int, returning: bool) -> str:
        return (
            f"UPDATE {self.n} SET locked_until = %s, next_retry_at = %s, "
            f"updated_at = %s WHERE {self._held(count)}"
            + (" RETURNING id" if returning else "")
        )

    @functools.cache  # noqa: B019
    def held(self, count: int) -> str:
        return f"SELECT id FROM {self.n} WHERE {self._held(count)}"

    @functools.cache  # noqa: B019
    def succeed(self, count: int) -> str:
        return (
            f"UPDATE {self.n} SET state = '{State.SUCCEEDED}', completed_at = %s, "
            "locked_until = NULL, lease_token = NULL, updated_at = %s "
            f"WHERE {self._held(count)}"
        )

    @functools.cache  # noqa: B019
    def lapse(self, count: int) -> str:
        return (
            f"UPDATE {self.n} SET state = '{State.SKIPPED}', "
            "attempts = attempts - 1, last_error = %s, last_error_type = %s, "
            "last_traceback = '', completed_at = %s, locked_until = NULL, "
            f"lease_token = NULL, updated_at = %s WHERE {self._held(count)}"
        )

    @functools.cache  # noqa: B019
    def release(self, count: int) -> str:
        # A row with a failed attempt before this claim goes back to FAILED
        # (the SET expressions read the values before the update).
        return (
            f"UPDATE {self.n} SET state = CASE WHEN attempts > 1 "
            f"THEN '{State.FAILED}' ELSE '{State.PENDING}' END, "
            "attempts = attempts - 1, next_retry_at = %s, locked_until = NULL, "
            "lease_token = NULL, locked_by = '', updated_at = %s "
            f"WHERE {self._held(count)}"
        )

    # -- stream delivery

    def current_tick(self, cursor) -> str | None:
        """A tick taken now through ``cursor`` (a DB-API cursor); None where
        a position alone is read (SQLite)."""
        return None

    def _in_tick(self, walk: bool) -> str:
        """The condition of an event (``e``) read in the tick (its
        parameters: :meth:`tick_params`): raises NotImplementedError where
        the database has no stream delivery."""
        raise NotImplementedError

    def tick_params(self, prev: str, cur: str, walk: bool) -> list:
        """The parameters of :meth:`_in_tick` for the events visible in tick
        ``cur`` and not in ``prev``."""
        return []

    def own_events(self) -> str | None:
        """The condition of an event (``e``) written by the reading
        transaction itself, where a tick's would miss it (PostgreSQL); None
        where the position read covers it (SQLite)."""
        return None

    @functools.cache  # noqa: B019
    def stream_read(
        self,
        type_count: int | None,
        partitioned: bool,
        held: int | None,
        walk: bool,
        own: bool = False,
    ) -> str:
        """A batch of stream delivery: the next events of a cursor, in position
        order, within a byte budget; one row per event.

        Columns: ``position``, the event columns
        (:attr:`Tables.event_columns
        <outbox_app.store.tables.Tables.event_columns>`), ``held`` (with
        ``held``: an unfinished delivery of the event's aggregate waits under
        one of ``held`` subscriber names, or an earlier event of it awaits row
        delivery's fan-out, so an ordered subscriber's event waits behind
        it), and how many events the limit let through before
        the byte budget (``candidates``). With ``own``: the events of the
        reading transaction itself (:meth:`own_events`), after a position,
        with no tick. Parameters: the ``held`` names, the tick's
        (:meth:`tick_params`; none with ``own``), ``type_count`` event types
        (None: every type), with ``partitioned`` the count of partitions and
        this one's number, the position read last (0: none yet), the limit,
        the byte budget.
        """
        e, n = self.e, self.n
        event_columns = self.tables.event_columns
        columns = ["e.position", *(f"e.{c}" for c in event_columns)]
        if held is not None:
            # An unfinished row of its aggregate, or an earlier event of it
            # written for row delivery and not fanned out yet (an upgrade's).
            names = ", ".join(["%s"] * held)
            columns.append(
                f"(EXISTS (SELECT 1 FROM {n} u WHERE u.subscriber IN ({names}) "
                "AND u.aggregate_type = e.aggregate_type "
                "AND u.aggregate_id = e.aggregate_id "
                f"AND u.state IN ({self.unfinished}){self.probe_fence}) "
                f"OR EXISTS (SELECT 1 FROM {e} f WHERE NOT f.fanned_out "
                "AND f.event_type IS NOT NULL "
                "AND f.aggregate_type = e.aggregate_type "
                "AND f.aggregate_id = e.aggregate_id "
                f"AND f.position < e.position{self.probe_fence})) AS held"
            )
        where = [
            self.own_events() if own else self._in_tick(walk),
            self.streamed_event(),
        ]
        if type_count is not None:
            where.append(f"e.event_type IN ({', '.join(['%s'] * type_count)})")
        if partitioned:
            where.append(f"{self.partition_hash('e')} %% %s = %s")
        where.append("e.position > %s")
        # Sorted, a tick's events are found by the index of the tick's
        # condition and sorted (the ordering is an expression, so the planner
        # never walks the position index instead, through every event older
        # than the tick); walking, by the position index.
        order = "e.position" if walk else "e.position + 0"
        candidates = (
            f"SELECT {', '.join(columns)} FROM {e} e WHERE {' AND '.join(where)} "
            f"ORDER BY {order} LIMIT %s"
        )
        budget = (
            "SELECT k.*, SUM(k.payload_bytes) OVER (ORDER BY k.position "
            "ROWS UNBOUNDED PRECEDING) AS running, ROW_NUMBER() OVER "
            "(ORDER BY k.position) AS n, COUNT(*) OVER () AS candidates "
            f"FROM ({candidates}) k"
        )
        names = ["position", *event_columns] + (["held"] if held is not None else [])
        within = (
            f"SELECT {', '.join(f'w.{c}' for c in names)}, w.candidates "
            f"FROM ({budget}) w WHERE w.running <= %s OR w.n <= 1"
        )
        return within + " ORDER BY w.position"

    def partition_hash(self, alias: str) -> str:
        """SQL for a non-negative hash of an event's (``alias``) aggregate
        (its id where it has none): an event's partition is this hash modulo
        the partitions, so an aggregate's events share one."""
        raise NotImplementedError

    def cursor_covers(self, e: str = "e") -> str:
        """The condition that an event (``e``, written for stream delivery)
        is the cursor ``c``'s to deliver: in its partition, and published
        after the cursor started."""
        return (
            f"(c.partitions = 1 OR {self.partition_hash(e)} %% c.partitions "
            f"= c.partition) AND {self._after_origin(e)}"
        )

    def _after_origin(self, e: str) -> str:
        raise NotImplementedError

    def cursor_passed(self, e: str = "e") -> str:
        """The condition that the cursor ``c`` has read past the event
        ``e``."""
        raise NotImplementedError

    def unread_hint(self, e: str = "e") -> str:
        """A condition every event (``e``) the cursor ``c`` has not read
        meets, which an index serves: a scan's bound, implied by ``NOT``
        :meth:`cursor_passed`."""
        raise NotImplementedError

    def cursor_unread(self, e: str = "e") -> str:
        """The condition that the cursor ``c`` has not read the event ``e``
        (its index-served bound included)."""
        return f"{self.unread_hint(e)} AND NOT {self.cursor_passed(e)}"

    def streamed_event(self, e: str = "e") -> str:
        """The condition that the event ``e`` was written for stream
        delivery (and is not an action's sentinel)."""
        return f"{e}.fanned_out IS NULL AND {e}.event_type IS NOT NULL"

    def awaited(self, e: str) -> str:
        """The condition that some cursor has still to deliver the event
        ``e`` (an expression naming the events table's row): one that covers
        it, has not read past it, and whose subscriber's subscription to its
        type is active."""
        return (
            f"EXISTS (SELECT 1 FROM {self.c} c WHERE {self.cursor_covers(e)} "
            f"AND {self.cursor_unread(e)} AND {self.cursor_takes(e)})"
        )

    def cursor_takes(self, e: str = "e") -> str:
        """The condition that the cursor ``c``'s subscriber has an active
        subscription to the type of the event ``e``."""
        return (
            f"EXISTS (SELECT 1 FROM {self.s} s WHERE s.subscriber = c.subscriber "
            f"AND s.retired_at IS NULL AND (s.event_type = '{WILDCARD}' OR "
            f"s.event_type = {e}.event_type))"
        )

    def delivered_by_stream(self, e: str = "e") -> str:
        """The condition that the cursor ``c`` delivered the event ``e``
        (written for stream delivery) by stream: it covers it and has read
        past it, its subscriber's active subscriptions take its type, and
        that subscriber has no row of it."""
        return (
            f"{self.cursor_covers(e)} AND {self.cursor_passed(e)} AND "
            f"{self.cursor_takes(e)} AND NOT EXISTS (SELECT 1 FROM {self.n} x "
            f"WHERE x.event_id = {e}.id AND x.subscriber = c.subscriber)"
        )

    @functools.cached_property
    def streamed(self) -> str:
        """``(event id, subscriber)`` of every event delivered by stream
        (:meth:`delivered_by_stream`). No parameters."""
        return (
            f"SELECT e.id, c.subscriber FROM {self.e} e JOIN {self.c} c ON "
            f"{self.delivered_by_stream()} WHERE {self.streamed_event()}"
        )

    def streamed_count(self) -> str:
        """How many subscribers delivered the event (the events table's row,
        by its name) by stream: a scalar subquery."""
        return (
            f"(SELECT COUNT(*) FROM {self.c} c WHERE "
            f"{self.delivered_by_stream(self.e)})"
        )

    #: A tick before every event: a cursor starting there reads every event
    #: kept.
    EMPTY_TICK = ""

    def first_reading(self, using: str, earliest: bool) -> tuple[str | None, int]:
        """Where a new cursor starts: ``(tick, position)`` of the events
        committed from now on (the current tick: on PostgreSQL, inside a
        transaction that has written, as one publishing that records the
        subscribers it knows of, that transaction's own events are the
        cursor's too, its id counting as running), or with ``earliest`` of
        every event kept (:attr:`EMPTY_TICK`)."""
        if earliest:
            return self.EMPTY_TICK, 0
        with connections[using].cursor() as cursor:
            return self.current_tick(cursor), 0

    @functools.cached_property
    def take_cursor(self) -> str:
        """Lease a cursor (by id) that is free or whose lease ran out, and
        read its state. Parameters: the lease token, the worker, the lease's
        expiry, now; the id; now. Returns ``tick, next_tick, position,
        stop_tick, own_position`` (no row: another relay holds it); without
        ``UPDATE ... RETURNING``, nothing (:meth:`held_cursor` reads it)."""
        return (
            f"UPDATE {self.c} SET lease_token = %s, locked_by = %s, "
            "locked_until = %s, wanted_by = '', updated_at = %s WHERE id = %s "
            "AND (lease_token IS NULL OR locked_until IS NULL OR locked_until "
            f"<= %s){self._returning(self.TAKEN)}"
        )

    #: What taking a cursor reads of it (:meth:`take_cursor`).
    TAKEN = "tick, next_tick, position, stop_tick, own_position"

    def _returning(self, columns: str) -> str:
        """`` RETURNING columns`` where an ``UPDATE`` may return them."""
        return f" RETURNING {columns}" if self.update_returning else ""

    @functools.cache  # noqa: B019
    def held_cursor(self, columns: str) -> str:
        """Read ``columns`` of a cursor (by id) held under a lease token:
        what an ``UPDATE ... RETURNING`` of it would have, where there is
        none. Parameters: the id, the token."""
        return f"SELECT {columns} FROM {self.c} WHERE id = %s AND lease_token = %s"

    @functools.cached_property
    def advance_cursor(self) -> str:
        """Write a cursor's state and extend its lease, fenced by the lease
        token. Parameters: tick, next tick, position, the lease's expiry,
        when a tick was read to its end (NULL: none was), now; the id, the
        token. Returns ``wanted_by`` (no row: the lease was lost); without
        ``UPDATE ... RETURNING``, nothing (:meth:`held_cursor` reads it)."""
        return (
            f"UPDATE {self.c} SET tick = %s, next_tick = %s, position = %s, "
            "locked_until = %s, ticked_at = COALESCE(%s, ticked_at), "
            "updated_at = %s WHERE id = %s AND lease_token = %s"
            + self._returning("wanted_by")
        )

    @functools.cached_property
    def own_cursor(self) -> str:
        """Write the last position delivered of the reading transaction's
        own events, fenced by the lease token. Parameters: the position; the
        id, the token."""
        return (
            f"UPDATE {self.c} SET own_position = %s WHERE id = %s AND lease_token = %s"
        )

    @functools.cached_property
    def release_cursor(self) -> str:
        """Hand a cursor back with its state, fenced by the lease token.
        Parameters: tick, next tick, position, when a tick was read to its
        end (NULL: none was), now; the id, the token."""
        return (
            f"UPDATE {self.c} SET tick = %s, next_tick = %s, position = %s, "
            "lease_token = NULL, locked_by = '', locked_until = NULL, "
            "ticked_at = COALESCE(%s, ticked_at), updated_at = %s "
            "WHERE id = %s AND lease_token = %s"
        )

    #: What a diverted delivery row sets besides the event's copied columns,
    #: in the parameters' order (see :meth:`divert`).
    DIVERTED = (
        "subscriber",
        "state",
        "attempts",
        "next_retry_at",
        "locked_until",
        "locked_by",
        "lease_token",
        "last_error",
        "last_error_type",
        "last_traceback",
        "first_failed_at",
        "completed_at",
        "created_at",
        "updated_at",
    )

    @functools.cache  # noqa: B019
    def divert(self, returning: bool) -> str:
        """Insert the delivery row of one event stream delivery passes without
        delivering it (the ``divert`` transition): the event's
        copied columns, then :data:`DIVERTED` (parameters, in that
        order), every other column at its model field's default; an existing
        ``(event, subscriber)`` row is left alone. The last parameter: the
        event's id. ``returning``: the new row's id comes back (where an
        ``UPDATE`` may return rows; elsewhere the cursor's ``lastrowid``
        is it)."""
        return self.divert_from(f"FROM {self.e} e WHERE e.id = %s") + (
            self._returning("id") if returning else ""
        )

    def divert_from(self, source: str) -> str:
        """:meth:`divert` of every event (``e``) ``source`` (a ``FROM ...``
        clause) selects: :data:`DIVERTED`'s parameters, then ``source``'s."""
        row = self._copied("e")
        row.update((name, "%s") for name in self.DIVERTED)
        columns, values = self._with_defaults(row)
        prefix, suffix = self.insert_ignore
        return f"{prefix} {self.n} ({columns}) SELECT {values} {source}{suffix}"

    def unread(self, type_count: int | None) -> str:
        """``FROM ... WHERE ...``: the events written for stream delivery
        (``e``, of ``type_count`` types, None: every type) that a
        subscriber's cursors (``c``) are to deliver and have not read yet.
        Parameters: the subscriber, then the types."""
        types = (
            ""
            if type_count is None
            else f" AND e.event_type IN ({', '.join(['%s'] * type_count)})"
        )
        return (
            f"FROM {self.e} e JOIN {self.c} c ON c.subscriber = %s "
            f"AND {self.cursor_covers()} WHERE {self.streamed_event()}{types} "
            f"AND {self.cursor_unread()}"
        )
