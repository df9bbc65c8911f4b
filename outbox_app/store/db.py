"""The one place that knows how the databases differ.

Everything here asks ``connection.features`` (or the vendor, for the two things
no feature flag names: SQLite's single-writer file and PostgreSQL's
LISTEN/NOTIFY) and gives the rest of the app one portable operation.
"""

from __future__ import annotations

import datetime
import functools
import logging
import re
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from django.conf import settings
from django.core.exceptions import EmptyResultSet
from django.db import DatabaseError, connections, models
from django.db.models import Q, QuerySet
from django.db.models.constants import OnConflict
from django.db.models.sql import InsertQuery
from django.utils import timezone
from django.utils.dateparse import parse_datetime

from ..events.codec import loads

logger = logging.getLogger("outbox_app.relay")

T = TypeVar("T")


class FilteredIndex(models.Index):
    """A partial index where the database has them (PostgreSQL, SQLite); elsewhere
    (MySQL/MariaDB, where Django would drop the condition) a composite index led
    by ``fallback_prefix``, the columns the condition tests.

    One migration serves all three databases.
    """

    def __init__(
        self,
        *,
        fields: list[str] | tuple[str, ...],
        name: str,
        when: Q,
        fallback_prefix: list[str] | tuple[str, ...],
    ):
        super().__init__(fields=fields, name=name)
        self.when = when
        self.fallback_prefix = list(fallback_prefix)

    def deconstruct(self) -> tuple[str, tuple, dict[str, Any]]:
        _, args, kwargs = super().deconstruct()
        kwargs.update(when=self.when, fallback_prefix=self.fallback_prefix)
        return "outbox_app.store.db.FilteredIndex", args, kwargs

    def _concrete(self, connection) -> models.Index:
        if connection.features.supports_partial_indexes:
            return models.Index(fields=self.fields, name=self.name, condition=self.when)
        return models.Index(
            fields=[*self.fallback_prefix, *self.fields], name=self.name
        )

    def create_sql(self, model, schema_editor, using="", **kwargs):
        concrete = self._concrete(schema_editor.connection)
        return concrete.create_sql(model, schema_editor, using=using, **kwargs)


def lock_waiting(queryset: QuerySet) -> QuerySet:
    """``select_for_update()`` that waits for other lockers; a no-op on SQLite."""
    if not connections[queryset.db].features.has_select_for_update:
        return queryset
    return queryset.select_for_update()


def insert_select(model: type[models.Model], columns: dict[str, Any], source) -> int:
    """``INSERT INTO <model> (<columns>) SELECT ... FROM <source>``, skipping rows
    that would break a unique constraint; no row passes through Python.

    Args:
        model: the table written.
        columns: column name -> expression over ``source``'s model (``F()`` to
            copy a column, ``Value()`` for a constant), in insertion order.
        source: the queryset the rows come from; its ordering is kept.

    Returns:
        Rows inserted.

    The conflict clause is Django's own, per backend (``ON CONFLICT DO
    NOTHING``, ``INSERT IGNORE``, ``INSERT OR IGNORE``), as ``bulk_create(...,
    ignore_conflicts=True)`` writes it.
    """
    connection = connections[source.db]
    ops = connection.ops
    names = {f"_col{i}": expression for i, expression in enumerate(columns.values())}
    select = source.annotate(**names).values(*names)
    try:
        sql, params = select.query.get_compiler(connection=connection).as_sql()
    except EmptyResultSet:  # e.g. ``id__in=[]``: nothing to insert
        return 0
    statement = " ".join(
        part
        for part in (
            ops.insert_statement(on_conflict=OnConflict.IGNORE),
            ops.quote_name(model._meta.db_table),
            f"({', '.join(map(ops.quote_name, columns))})",
            sql,
            ops.on_conflict_suffix_sql([], OnConflict.IGNORE, None, None),
        )
        if part
    )
    with connection.cursor() as cursor:
        cursor.execute(statement, params)
        return cursor.rowcount


def insert_new(
    objs: Sequence[models.Model], returning: Sequence[str], using: str
) -> list[tuple] | None:
    """INSERT ``objs`` (unsaved instances of one model), skipping those that
    would break a unique constraint, and return the ``returning`` fields of
    the rows inserted: one statement per :meth:`bulk_batch_size` rows, ``ON
    CONFLICT DO NOTHING`` / ``INSERT IGNORE`` / ``INSERT OR IGNORE`` (as
    ``bulk_create(..., ignore_conflicts=True)`` writes it) with ``RETURNING``,
    written by Django's own insert compiler. A row another transaction has
    inserted and not committed yet is waited for, then skipped.

    Returns:
        The inserted rows' values (tuples in ``returning``'s order), or
        ``None`` where the database cannot return rows from a bulk insert
        (MySQL; SQLite before 3.35): the caller inserts another way.
    """
    connection = connections[using]
    if not objs or not connection.features.can_return_rows_from_bulk_insert:
        return None if objs else []
    meta = objs[0]._meta
    fields = [f for f in meta.concrete_fields if not f.primary_key]
    returned = [meta.get_field(name) for name in returning]
    size = connection.ops.bulk_batch_size(fields, objs) or len(objs)
    found: list[tuple] = []
    with connection.cursor() as cursor:
        for start in range(0, len(objs), size):
            query = InsertQuery(meta.model, on_conflict=OnConflict.IGNORE)
            query.insert_values(fields, objs[start : start + size])
            compiler = query.get_compiler(connection=connection)
            compiler.returning_fields = returned
            [(sql, params)] = compiler.as_sql()
            cursor.execute(sql, params)
            found.extend(tuple(row) for row in cursor.fetchall())
    return found


@dataclass(frozen=True)
class Dialect:
    """What the relay's raw statements (``delivery/gateway.py``) need to know
    about one database: its capabilities and how values cross the DB-API.

    Attributes:
        alias, vendor: the database alias and ``connection.vendor``.
        skip_locked: ``SELECT ... FOR UPDATE SKIP LOCKED`` (PostgreSQL, MySQL 8,
            MariaDB 10.6+); SQLite serialises its writers instead.
        lock_of: ``FOR UPDATE OF <table>`` (PostgreSQL).
        update_returning: ``UPDATE ... RETURNING`` (PostgreSQL; SQLite 3.35+,
            whose RETURNING may hold scalar subqueries but not a join).
        writable_cte: data-modifying statements in ``WITH`` (PostgreSQL): a
            claim and its read, or a fan-out batch's lock, insert and flip,
            are one statement.
        array_parameter: one list parameter for ``= ANY(%s)`` (PostgreSQL);
            elsewhere a list is spelled ``IN (%s, %s, ...)``.
        native_uuid: UUIDs cross as ``uuid.UUID``; elsewhere as 32 hex digits.
        probe_fence: appended to a correlated ``NOT EXISTS`` subquery so it
            runs as a probe per outer row, by index (PostgreSQL: ``OFFSET 0``
            keeps the planner from turning it into an anti-join, whose plan
            depends on statistics; see ``gateway._candidates``).
        clock_sql: a query of the database server's clock, UTC (PostgreSQL's
            ``clock_timestamp()``, the time it runs even inside a
            transaction; MySQL/MariaDB's ``UTC_TIMESTAMP(6)``); None for
            SQLite, an embedded database whose clock is the process's own.
    """

    alias: str
    vendor: str
    skip_locked: bool
    lock_of: bool
    update_returning: bool
    writable_cte: bool
    array_parameter: bool
    native_uuid: bool
    quote_char: str
    probe_fence: str
    clock_sql: str | None

    def quote(self, name: str) -> str:
        return f"{self.quote_char}{name}{self.quote_char}"

    def in_list(self, column: str, count: int) -> str:
        """``column`` is one of a list of ``count`` parameters."""
        if self.array_parameter:
            return f"{column} = ANY(%s)"
        return f"{column} IN ({', '.join(['%s'] * count)})"

    def positions(self, table: str, count: int) -> list[str] | None:
        """SQL for the ``position`` of each of ``count`` rows one INSERT
        writes into ``table`` (quoted), in order, where the INSERT is to give
        it: SQLite, where numbering them here saves the trigger's UPDATE per
        row (its writers are serialised, so ``MAX() + n`` is free). None
        where the column's default numbers them (see
        :func:`number_positions`)."""
        if self.vendor != "sqlite":
            return None
        return [
            f"(SELECT COALESCE(MAX(position), 0) + {n} FROM {table})"
            for n in range(1, count + 1)
        ]

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
        if isinstance(value, str):
            value = parse_datetime(value)
        if value is not None and settings.USE_TZ and timezone.is_naive(value):
            value = timezone.make_aware(value, connections[self.alias].timezone)
        return value

    @staticmethod
    def json_value(value: Any) -> Any:
        """A JSON column's value: the drivers return its text (Django registers
        PostgreSQL's jsonb loader as text, as ``JSONField`` expects)."""
        if isinstance(value, bytes):
            value = value.decode()
        return loads(value) if isinstance(value, str) else value


def dialect(alias: str) -> Dialect:
    """The :class:`Dialect` of database ``alias`` (looked up per call: cheap,
    and right in every thread, whose connections are their own)."""
    return _dialect(alias, connections[alias].vendor)


@functools.cache
def _dialect(alias: str, vendor: str) -> Dialect:
    connection = connections[alias]
    features = connection.features
    returning = vendor == "postgresql"
    if vendor == "sqlite":
        returning = connection.Database.sqlite_version_info >= (3, 35)
    return Dialect(
        alias=alias,
        vendor=vendor,
        skip_locked=features.has_select_for_update_skip_locked,
        lock_of=features.has_select_for_update_of,
        update_returning=returning,
        writable_cte=vendor == "postgresql",
        array_parameter=vendor == "postgresql",
        native_uuid=features.has_native_uuid_field,
        quote_char=connection.ops.quote_name("x")[0],
        probe_fence=" OFFSET 0" if vendor == "postgresql" else "",
        clock_sql={
            "postgresql": "SELECT clock_timestamp()",
            "mysql": "SELECT UTC_TIMESTAMP(6)",
        }.get(vendor),
    )


# --- the database's clock ----------------------------------------------------------


def _update_from(vendor: str, table: str, source: str, on: str, columns) -> str:
    """``UPDATE table t`` setting each of ``columns`` to the same column of the
    rows of ``source`` (aliased ``o``) matched by ``on``: ``UPDATE ... FROM``
    (PostgreSQL, SQLite 3.33+) or a multi-table ``UPDATE ... JOIN``
    (MySQL/MariaDB, where the target's columns are qualified)."""
    if vendor == "mysql":
        assign = ", ".join(f"t.{c} = o.{c}" for c in columns)
        return f"UPDATE {table} t JOIN {source} o ON {on} SET {assign}"
    assign = ", ".join(f"{c} = o.{c}" for c in columns)
    return f"UPDATE {table} AS t SET {assign} FROM {source} AS o WHERE {on}"


def number_positions(schema_editor, model: type[models.Model]) -> None:
    """Number the existing rows of ``model`` (``OutboxEvent``) in its
    ``position`` column in id order (1, 2, ...), and have the database number
    each row inserted later without one (left out, or NULL) after every
    number given so far, whoever inserts it (``publish()``, the ORM, raw SQL).

    PostgreSQL: a sequence as the column's default, and a trigger for an
    explicit NULL (the ORM writes every column). MySQL/MariaDB:
    ``AUTO_INCREMENT`` (allowed on a column that leads an index: its unique
    index). SQLite: a trigger taking ``MAX(position) + 1`` after each row
    (its writers are serialised, so no two take the same number). SQLite
    loses a table's triggers when Django rebuilds the table (most
    ``AlterField`` operations there): a later migration that rebuilds this
    table runs this again (the numbering of existing rows is kept: only
    NULLs are numbered).
    """
    connection = schema_editor.connection
    vendor = connection.vendor
    q = connection.ops.quote_name
    table = model._meta.db_table
    t, seq, trigger = q(table), f"{table}_position_seq", q(f"{table}_position")
    numbered = (
        f"(SELECT id, ROW_NUMBER() OVER (ORDER BY id) "
        f"+ (SELECT COALESCE(MAX(position), 0) FROM {t}) AS position "
        f"FROM {t} WHERE position IS NULL)"
    )
    statements = [_update_from(vendor, t, numbered, "o.id = t.id", ["position"])]
    if vendor == "postgresql":
        statements += [
            f"CREATE SEQUENCE IF NOT EXISTS {q(seq)} OWNED BY {t}.position",
            f"SELECT setval('{seq}', COALESCE(MAX(position), 0) + 1, false) FROM {t}",
            f"ALTER TABLE {t} ALTER COLUMN position SET DEFAULT nextval('{seq}')",
            f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN NEW.position := nextval('{seq}'); "
            "RETURN NEW; END $$",
            f"DROP TRIGGER IF EXISTS {trigger} ON {t}",
            f"CREATE TRIGGER {trigger} BEFORE INSERT ON {t} FOR EACH ROW "
            f"WHEN (NEW.position IS NULL) EXECUTE FUNCTION {trigger}()",
        ]
    elif vendor == "mysql":
        statements.append(f"ALTER TABLE {t} MODIFY position bigint AUTO_INCREMENT")
    else:
        statements += [
            f"DROP TRIGGER IF EXISTS {trigger}",
            f"CREATE TRIGGER {trigger} AFTER INSERT ON {t} FOR EACH ROW "
            f"WHEN NEW.position IS NULL BEGIN UPDATE {t} SET position = "
            f"(SELECT COALESCE(MAX(position), 0) + 1 FROM {t}) "
            "WHERE rowid = NEW.rowid; END",
        ]
    for statement in statements:
        schema_editor.execute(statement, params=None)


def json_bytes(vendor: str, column: str) -> str:
    """SQL for the length in bytes of the JSON text stored in ``column``
    (0 for NULL)."""
    text = {
        "postgresql": f"octet_length({column}::text)",
        "mysql": f"LENGTH({column})",
    }.get(vendor, f"length(CAST({column} AS BLOB))")
    return f"COALESCE({text}, 0)"


def copy_to_deliveries(schema_editor, events, deliveries, columns) -> None:
    """Copy ``columns`` of each event (model ``events``) onto its deliveries
    (model ``deliveries``, whose ``event_id`` names it): one UPDATE."""
    connection = schema_editor.connection
    q = connection.ops.quote_name
    schema_editor.execute(
        _update_from(
            connection.vendor,
            q(deliveries._meta.db_table),
            q(events._meta.db_table),
            "o.id = t.event_id",
            columns,
        ),
        params=None,
    )


#: What :func:`violated_constraint` returns for a primary key.
PRIMARY_KEY = "primary key"


def violated_constraint(error: Exception, model: type[models.Model]) -> str | None:
    """The unique constraint of ``model`` that ``error`` (an ``IntegrityError``
    from an INSERT into its table) reports: the name of one of its
    ``Meta.constraints``, :data:`PRIMARY_KEY`, or None for anything else (a
    constraint or index of the project's own, a NOT NULL, a check).

    Read from what each driver says of the constraint, never from words of the
    message a value could contain: psycopg's ``diag.constraint_name``
    (PostgreSQL names a primary key ``<table>_pkey``); MySQL/MariaDB's ``for
    key '<name>'`` (``PRIMARY``); SQLite's ``UNIQUE constraint failed:
    <table>.<column>, ...``, matched to the constraint on those columns.
    """
    unique = {
        c.name: tuple(model._meta.get_field(f).column for f in c.fields)
        for c in model._meta.constraints
        if isinstance(c, models.UniqueConstraint) and c.fields
    }
    table = model._meta.db_table
    cause = error.__cause__ or error
    diag = getattr(cause, "diag", None)
    if diag is not None:  # psycopg
        name = diag.constraint_name
        if name == f"{table}_pkey":
            return PRIMARY_KEY
        return name if name in unique else None
    text = str(cause)
    key = re.search(r"for key '(?:[^']*\.)?([^'.]+)'", text)  # MySQL, MariaDB
    if key is not None:
        name = key.group(1)
        if name == "PRIMARY":
            return PRIMARY_KEY
        return name if name in unique else None
    failed = re.fullmatch(r"UNIQUE constraint failed: (.+)", text.strip())  # SQLite
    if failed is not None:
        columns = tuple(
            c.strip().rsplit(".", 1)[-1] for c in failed.group(1).split(",")
        )
        if columns == (model._meta.pk.column,):
            return PRIMARY_KEY
        for name, constrained in unique.items():
            if columns == constrained:
                return name
    return None


def deadlocked(error: Exception) -> bool:
    """Whether the database broke a deadlock by rolling back the transaction
    that raised ``error`` (a ``DatabaseError``): PostgreSQL's SQLSTATE
    ``40P01`` (psycopg's ``sqlstate``, psycopg2's ``pgcode``), MySQL/MariaDB's
    error 1213 (``ER_LOCK_DEADLOCK``). Such a victim is meant to run again
    ("always be prepared to re-issue a transaction if it fails due to
    deadlock": MySQL's InnoDB manual, *How to Minimize and Handle
    Deadlocks*); SQLite has one writer and no deadlocks."""
    cause = error.__cause__ or error
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code is not None:
        return code == "40P01"
    args = getattr(cause, "args", ())
    return bool(args) and args[0] == 1213


#: How many times a statement runs when the database keeps choosing it as a
#: deadlock victim.
DEADLOCK_ATTEMPTS = 5


def reissued_on_deadlock(alias: str, step: Callable[[], T], name: str) -> T:
    """Run ``step()`` (statements of its own on database ``alias``) and run it
    again, up to :data:`DEADLOCK_ATTEMPTS` times, when the database broke a
    deadlock by rolling it back (:func:`deadlocked`): relays working side by
    side on MariaDB deadlock now and then, InnoDB waiting on index records
    another relay is marking or inserting. A step outside a transaction
    committed nothing when it was the victim; inside a caller's transaction
    the whole transaction is gone, so the error is the caller's and is raised
    at once. ``step`` must be safe to run again (every relay step is);
    ``name`` names it in the debug log.

    Raises:
        DatabaseError: anything but a deadlock, or the last deadlock.
    """
    attempts = 1 if connections[alias].in_atomic_block else DEADLOCK_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return step()
        except DatabaseError as exc:
            if attempt == attempts or not deadlocked(exc):
                raise
            logger.debug("%s was a deadlock victim, reissued", name)
    raise AssertionError("unreachable")


#: libpq's ``PQTRANS_INERROR`` (psycopg and psycopg2 alike): the transaction
#: met an error and can only roll back.
_PQ_TRANS_INERROR = 3


def transaction_broken(connection) -> str | None:
    """Why ``connection``'s (a Django connection) open transaction can no
    longer commit what was written in it, or None: Django marked it for
    rollback, or PostgreSQL aborted it after an error that was caught with no
    savepoint around it (its COMMIT would then roll back without an error;
    MySQL, MariaDB and SQLite undo the failed statement alone). Read from the
    connection's state, no round trip. Completes a message for
    :class:`~outbox_app.exceptions.TransactionBroken`: "the handler ..."."""
    if connection.needs_rollback:
        return (
            "left the transaction marked for rollback (a database error caught "
            "inside atomic(), or transaction.set_rollback(True))"
        )
    raw = connection.connection
    if connection.vendor != "postgresql" or raw is None:
        return None
    pgconn = getattr(raw, "pgconn", None)  # psycopg 3; psycopg2 has info
    status = (pgconn if pgconn is not None else raw.info).transaction_status
    if int(status) == _PQ_TRANS_INERROR:
        return (
            "left the transaction aborted (a database error caught with no "
            "savepoint around it)"
        )
    return None


def is_single_writer(alias: str) -> bool:
    """True for SQLite: one relay process per database file."""
    return connections[alias].vendor == "sqlite"


# --- wake-ups across processes -------------------------------------------------------
