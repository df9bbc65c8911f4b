"""Database work beyond the ORM's, the same on every database: inserts that
skip duplicates, locks that wait, a step that must not wait for another
transaction's locks, the migrations' helpers, a step run again when it was a
deadlock victim, and whether a transaction can still commit.
What differs per database is asked of :func:`~outbox_app.store.sql.dialect`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from django.core.exceptions import EmptyResultSet
from django.db import DatabaseError, connections, models, transaction
from django.db.models import Q, QuerySet
from django.db.models.constants import OnConflict
from django.db.models.sql import InsertQuery

from .sql import dialect, dialect_of

logger = logging.getLogger("outbox_app.relay")

T = TypeVar("T")


class FilteredIndex(models.Index):
    """A partial index where the database has them (PostgreSQL, SQLite); elsewhere
    (MySQL/MariaDB, where Django would drop the condition) a composite index led
    by ``fallback_prefix``, the columns the condition tests: the shape is the
    dialect's (:meth:`~outbox_app.store.sql.base.Dialect.filtered_index`).

    ``fallback_prefix`` None: no index at all where there are no partial
    indexes (an index of a column only another database fills).

    One migration serves all three databases.
    """

    def __init__(
        self,
        *,
        fields: list[str] | tuple[str, ...],
        name: str,
        when: Q,
        fallback_prefix: list[str] | tuple[str, ...] | None,
    ):
        super().__init__(fields=fields, name=name)
        self.when = when
        self.fallback_prefix = (
            None if fallback_prefix is None else list(fallback_prefix)
        )

    def deconstruct(self) -> tuple[str, tuple, dict[str, Any]]:
        _, args, kwargs = super().deconstruct()
        kwargs.update(when=self.when, fallback_prefix=self.fallback_prefix)
        return "outbox_app.store.db.FilteredIndex", args, kwargs

    def create_sql(self, model, schema_editor, using="", **kwargs):
        d = dialect_of(schema_editor.connection)
        concrete = d.filtered_index(self)
        if concrete is None:
            return d.no_op
        return concrete.create_sql(model, schema_editor, using=using, **kwargs)

    def remove_sql(self, model, schema_editor, **kwargs):
        d = dialect_of(schema_editor.connection)
        concrete = d.filtered_index(self)
        if concrete is None:
            return d.no_op
        return concrete.remove_sql(model, schema_editor, **kwargs)


def lock_waiting(queryset: QuerySet) -> QuerySet:
    """``select_for_update()`` that waits for other lockers; a no-op on SQLite."""
    if not connections[queryset.db].features.has_select_for_update:
        return queryset
    return queryset.select_for_update()


def unless_waiting(alias: str, step: Callable[[], T]) -> T | None:
    """Run ``step()`` (statements of its own on database ``alias``) in a
    savepoint that gives up where a statement would wait for a lock another
    open transaction holds (the dialect's ``lock_wait``): then the savepoint
    is rolled back and None returned, else ``step()``'s value. An insert
    whose unique key another open transaction has just written waits for
    that transaction to end, however long it stays open: bookkeeping that
    transaction already does is left to it. The lock wait is the
    connection's own again afterwards. Where writers never wait on each
    other's rows (SQLite, one writer at a time) ``step()`` simply runs.

    Raises:
        DatabaseError: any error of ``step()`` but giving up on the wait.
    """
    d = dialect(alias)
    if d.lock_wait is None:
        return step()
    read, set_to = d.lock_wait
    with transaction.atomic(using=alias), connections[alias].cursor() as cursor:
        cursor.execute(read)
        (before,) = cursor.fetchone()
        cursor.execute(set_to, [d.no_lock_wait])
        try:
            with transaction.atomic(using=alias):
                return step()
        except DatabaseError as exc:
            if not d.gave_up_waiting(exc):
                raise
            return None
        finally:
            cursor.execute(set_to, [before])


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


def number_positions(schema_editor, model: type[models.Model]) -> None:
    """Number the existing rows of ``model`` (``OutboxEvent``) in its
    ``position`` column in id order (1, 2, ...), and have the database number
    each row inserted later without one (left out, or NULL) after every
    number given so far, whoever inserts it (``publish()``, the ORM, raw SQL).

    How each database numbers is its dialect's
    (:meth:`~outbox_app.store.sql.base.Dialect.position_numbering`). SQLite
    loses a table's triggers when Django rebuilds the table (most
    ``AlterField`` operations there): a later migration that rebuilds this
    table runs this again (the numbering of existing rows is kept: only
    NULLs are numbered).
    """
    connection = schema_editor.connection
    d = dialect_of(connection)
    table = model._meta.db_table
    t = connection.ops.quote_name(table)
    numbered = (
        f"(SELECT id, ROW_NUMBER() OVER (ORDER BY id) "
        f"+ (SELECT COALESCE(MAX(position), 0) FROM {t}) AS position "
        f"FROM {t} WHERE position IS NULL)"
    )
    statements = [
        d.update_from(t, numbered, "o.id = t.id", ["position"]),
        *d.position_numbering(table),
    ]
    for statement in statements:
        schema_editor.execute(statement, params=None)


def copy_to_deliveries(schema_editor, events, deliveries, columns) -> None:
    """Copy ``columns`` of each event (model ``events``) onto its deliveries
    (model ``deliveries``, whose ``event_id`` names it): one UPDATE."""
    connection = schema_editor.connection
    q = connection.ops.quote_name
    schema_editor.execute(
        dialect_of(connection).update_from(
            q(deliveries._meta.db_table),
            q(events._meta.db_table),
            "o.id = t.event_id",
            columns,
        ),
        params=None,
    )


#: How many times a statement runs when the database keeps choosing it as a
#: deadlock victim.
DEADLOCK_ATTEMPTS = 5


def reissued_on_deadlock(alias: str, step: Callable[[], T], name: str) -> T:
    """Run ``step()`` (statements of its own on database ``alias``) and run it
    again, up to :data:`DEADLOCK_ATTEMPTS` times, when the database broke a
    deadlock by rolling it back (the dialect's ``deadlocked``): relays working
    side by side on MariaDB deadlock now and then, InnoDB waiting on index
    records another relay is marking or inserting. A step outside a transaction
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
            if attempt == attempts or not dialect(alias).deadlocked(exc):
                raise
            logger.debug("%s was a deadlock victim, reissued", name)
    raise AssertionError("unreachable")


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
    if dialect_of(connection).transaction_aborted(connection):
        return (
            "left the transaction aborted (a database error caught with no "
            "savepoint around it)"
        )
    return None
