"""PostgreSQL: one statement per relay step (writable CTEs), ``= ANY(%s)``
lists, ``LISTEN``/``NOTIFY``, positions from a sequence, and psycopg's
diagnostics."""

from __future__ import annotations

import functools
import types
from typing import Any

from django.db import models

from ...conf import outbox_settings
from ..lifecycle import State
from .base import (
    CLAIM_ASSIGN,
    PRIMARY_KEY,
    SUBSCRIBED,
    Dialect,
)

try:
    import psycopg

    class _Preparing(psycopg.Cursor):
        """Server-side binding, every statement prepared (psycopg 3)."""

        def execute(self, query, params=None, *, prepare=None, binary=None):
            super().execute(query, params, prepare=True, binary=binary)
            # What Django's query log reads (connection.queries, DEBUG): the
            # statement's text, where a client-binding cursor has its own.
            self._query = types.SimpleNamespace(query=str(query).encode())
            return self

except ImportError:  # psycopg2
    _Preparing = None

#: libpq's ``PQTRANS_INERROR`` (psycopg and psycopg2 alike): the transaction
#: met an error and can only roll back.
_PQ_TRANS_INERROR = 3


class PostgreSQLDialect(Dialect):
    vendor = "postgresql"
    update_returning = True
    writable_cte = True
    array_parameter = True
    probe_fence = " OFFSET 0"
    clock_sql = "SELECT clock_timestamp()"
    notifies = True
    stream = "snapshot"
    transaction_id_type = "xid8"
    current_transaction_id = "pg_current_xact_id()"

    # --- the schema ----------------------------------------------------------------

    def position_numbering(self, table: str) -> list[str]:
        """A sequence as the column's default, and a trigger for an explicit
        NULL (the ORM writes every column)."""
        t, seq, trigger = (
            self.quote(table),
            f"{table}_position_seq",
            self.quote(f"{table}_position"),
        )
        return [
            f"CREATE SEQUENCE IF NOT EXISTS {self.quote(seq)} OWNED BY {t}.position",
            f"SELECT setval('{seq}', COALESCE(MAX(position), 0) + 1, false) FROM {t}",
            f"ALTER TABLE {t} ALTER COLUMN position SET DEFAULT nextval('{seq}')",
            f"CREATE OR REPLACE FUNCTION {trigger}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN NEW.position := nextval('{seq}'); "
            "RETURN NEW; END $$",
            f"DROP TRIGGER IF EXISTS {trigger} ON {t}",
            f"CREATE TRIGGER {trigger} BEFORE INSERT ON {t} FOR EACH ROW "
            f"WHEN (NEW.position IS NULL) EXECUTE FUNCTION {trigger}()",
        ]

    def json_bytes(self, column: str) -> str:
        return f"COALESCE(octet_length({column}::text), 0)"

    def rename_index(self, table: str, old: str, new: str) -> str | None:
        """A unique constraint is renamed with its index."""
        return f"ALTER INDEX {self.quote(old)} RENAME TO {self.quote(new)}"

    # --- the relay's cursor ------------------------------------------------------

    def cursor(self, connection):
        """With ``OUTBOX_PREPARED_STATEMENTS`` on psycopg 3, a cursor that binds
        parameters on the server and prepares each statement on its first run
        (psycopg's ``execute(prepare=True)``: the connection keeps the plan,
        one per statement text), wrapped by Django as its own cursors are
        (errors, query logging). Otherwise Django's cursor, which binds on the
        client and never prepares (Django's default, for connection poolers).
        """
        if not outbox_settings.PREPARED_STATEMENTS or _Preparing is None:
            return connection.cursor()
        connection.ensure_connection()
        raw = connection.connection
        if raw.prepare_threshold is None:  # Django's: psycopg prepares nothing
            # Only what is asked (prepare=True): other cursors keep preparing
            # nothing in practice.
            raw.prepare_threshold = 2**31
        with connection.wrap_database_errors:
            return connection._prepare_cursor(_Preparing(raw))

    # --- the driver's errors -----------------------------------------------------

    def violated_constraint(
        self, error: Exception, model: type[models.Model]
    ) -> str | None:
        """psycopg's ``diag.constraint_name`` (PostgreSQL names a primary key
        ``<table>_pkey``)."""
        cause = error.__cause__ or error
        diag = getattr(cause, "diag", None)
        if diag is None:
            return None
        name = diag.constraint_name
        if name == f"{model._meta.db_table}_pkey":
            return PRIMARY_KEY
        return name if name in self._unique(model) else None

    def deadlocked(self, error: Exception) -> bool:
        """SQLSTATE ``40P01`` (psycopg's ``sqlstate``, psycopg2's ``pgcode``)."""
        return _sqlstate(error) == "40P01"

    # ``lock_timeout`` set with ``set_config(..., is_local => true)``: the
    # transaction's alone (PostgreSQL's manual, *Client Connection Defaults*).
    lock_wait = (
        "SELECT current_setting('lock_timeout')",
        "SELECT set_config('lock_timeout', %s, true)",
    )
    no_lock_wait = "1ms"

    def gave_up_waiting(self, error: Exception) -> bool:
        """SQLSTATE ``55P03`` (``lock_not_available``): ``lock_timeout``."""
        return _sqlstate(error) == "55P03"

    def transaction_aborted(self, connection) -> bool:
        """PostgreSQL aborts a transaction at its first error: its COMMIT then
        rolls back without an error. Read from libpq's transaction status."""
        raw = connection.connection
        if raw is None:
            return False
        pgconn: Any = getattr(raw, "pgconn", None)  # psycopg 3; psycopg2 has info
        status = (pgconn if pgconn is not None else raw.info).transaction_status
        return int(status) == _PQ_TRANS_INERROR

    # --- the relay's statements --------------------------------------------------

    @functools.cache  # noqa: B019 (one instance per database, kept for the process)
    def fan_out(self, type_count: int | None, paged: bool, claiming: bool) -> str:
        """One statement: lock a batch of events awaiting fan-out (``SKIP
        LOCKED``), insert their deliveries, flip the flag; when ``claiming``,
        the lease's subscriber's deliveries are inserted claimed and read
        with their event. Returns one row per event taken: its id, whether
        it was flipped, then the claimed delivery's columns or NULLs."""
        n, e = self.n, self.e
        where = self._awaiting(type_count, paged)
        tables = self.tables
        columns = (
            [*tables.event_columns, "position"] if claiming else tables.copied_columns
        )
        select = self._batch(where, columns, claiming, " FOR UPDATE SKIP LOCKED")
        pairs = self._subscriptions(claiming)
        inserted, values = self._delivery_row(claiming)
        # The events flipped are those the insert found a subscription for: s
        # is read once, by the same snapshot as the insert.
        created = (
            f"created AS (INSERT INTO {n} ({inserted}) SELECT {values} "
            f"FROM b JOIN s ON {SUBSCRIBED} ORDER BY b.id ON CONFLICT DO NOTHING"
            + (
                " RETURNING id, attempts, subscriber, event_id, state)"
                if claiming
                else ")"
            )
        )
        statement = (
            f"WITH b AS ({select}), s AS ({pairs}), "
            f"flipped AS (UPDATE {e} SET fanned_out = TRUE "
            f"WHERE id = ANY(ARRAY(SELECT b.id FROM b JOIN s ON {SUBSCRIBED})) "
            f"RETURNING id), {created} "
        )
        matched = "b.id IN (SELECT id FROM flipped)"
        if not claiming:
            return statement + f"SELECT b.id, {matched} FROM b ORDER BY b.id"
        event_columns = ", ".join(f"b.{c}" for c in tables.event_columns)
        return (
            statement + f"SELECT b.id, {matched}, c.id, c.attempts, c.subscriber, "
            f"{event_columns} FROM b LEFT JOIN created c ON c.event_id = b.id "
            f"AND c.state = '{State.RUNNING}' ORDER BY b.id"
        )

    @functools.cache  # noqa: B019
    def claim(self, names: int, ordered: bool, types: int | None) -> str:
        """One statement: the candidates locked (``FOR UPDATE OF c SKIP
        LOCKED``), updated and read with their events (``UPDATE ...
        RETURNING`` joined to the events)."""
        candidates = self.claim_ids(names, ordered, types if ordered else None)
        event_columns = ", ".join(f"e.{c}" for c in self.tables.event_columns)
        # = ANY(ARRAY(...)): the candidates become one array, computed once,
        # and the update finds its rows by primary key; as "IN (SELECT ...)"
        # PostgreSQL may hash-join a sequential scan of the whole table.
        return (
            f"WITH c AS (UPDATE {self.n} SET {CLAIM_ASSIGN} "
            f"WHERE id = ANY(ARRAY({candidates})) "
            "RETURNING id, attempts, subscriber, event_id) "
            f"SELECT c.id, c.attempts, c.subscriber, {event_columns} "
            f"FROM c JOIN {self.e} e ON e.id = c.event_id ORDER BY c.id"
        )

    # -- stream delivery: ticks are snapshots

    def current_tick(self, cursor) -> str:
        """A tick taken now: ``pg_current_snapshot()``, with the reading
        transaction's own id, where it has one (a relay run inside a
        caller's transaction, as a test's), listed as running: PostgreSQL
        leaves a transaction's own id out of its snapshots, so they count it
        as committed, and its events written after the tick would be taken
        as read. They are read on their own (:meth:`own_events`)."""
        cursor.execute(
            "SELECT pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text"
        )
        snapshot, own = cursor.fetchone()
        if own is None:
            return snapshot
        xmin, xmax, running = _snapshot(snapshot)
        if xmin <= int(own) < xmax and int(own) not in running:
            running = sorted([*running, int(own)])
        return f"{xmin}:{xmax}:{','.join(map(str, running))}"

    def _in_tick(self, walk: bool) -> str:
        """An event's transaction is visible in the tick read (``cur``) and
        was not in the last (``prev``): it began at or after ``prev``'s xmax
        and had ended (it committed: rolled back rows are never seen) by
        ``cur``, or it was running at ``prev`` and has ended since. Written
        as ranges and lists of ids (:meth:`tick_params`), it reads the
        transaction id index for just those: a long transaction running
        meanwhile is in neither and widens no scan. ``walk`` (a large tick
        read on in position order, by the position index): the same rule as
        ``pg_visible_in_snapshot`` tests, which no index serves."""
        if walk:
            return (
                "pg_visible_in_snapshot(e.txid, %s::pg_snapshot) "
                "AND NOT pg_visible_in_snapshot(e.txid, %s::pg_snapshot)"
            )
        return (
            "((e.txid >= %s::xid8 AND e.txid < %s::xid8 "
            "AND e.txid <> ALL(%s::xid8[])) OR e.txid = ANY(%s::xid8[]))"
        )

    def tick_params(self, prev: str, cur: str, walk: bool) -> list:
        """The parameters of :meth:`_in_tick`: the snapshots (``walk``), or
        ``prev``'s xmax, ``cur``'s, the transactions running at ``cur`` and
        those running at ``prev`` that have ended by ``cur``."""
        if walk:
            return [cur, prev]
        _, lo, was_running = _snapshot(prev)
        _, hi, running = _snapshot(cur)
        finished = sorted(set(was_running) - set(running))
        return [str(lo), str(hi), _array(running), _array(finished)]

    def partition_hash(self, alias: str) -> str:
        """``hashtext`` of ``<aggregate type>:<aggregate id>`` (the event id
        without an aggregate), its sign bit cleared."""
        return (
            f"(hashtext(COALESCE({alias}.aggregate_type || ':' || "
            f"{alias}.aggregate_id, {alias}.id::text)) & 2147483647)"
        )

    #: A tick in which no transaction is visible: a cursor starting there
    #: reads every event kept.
    EMPTY_TICK = "1:1:"

    def _after_origin(self, e: str) -> str:
        return f"NOT pg_visible_in_snapshot({e}.txid, c.first_tick::pg_snapshot)"

    def cursor_passed(self, e: str = "e") -> str:
        return (
            f"(pg_visible_in_snapshot({e}.txid, c.tick::pg_snapshot) OR "
            f"(c.next_tick IS NOT NULL AND pg_visible_in_snapshot({e}.txid, "
            f"c.next_tick::pg_snapshot) AND {e}.position <= c.position))"
        )

    def unread_hint(self, e: str = "e") -> str:
        """Not visible in a snapshot: begun at or after its xmin."""
        return f"{e}.txid >= pg_snapshot_xmin(c.tick::pg_snapshot)"

    def own_events(self) -> str | None:
        """The events of the reading transaction itself (none outside one)."""
        return "e.txid = pg_current_xact_id_if_assigned()"


def _snapshot(text: str) -> tuple[int, int, list[int]]:
    """A ``pg_snapshot``'s text (``xmin:xmax:xip,...``) as its xmin, its xmax
    and the transaction ids running in it."""
    xmin, xmax, running = text.split(":")
    return int(xmin), int(xmax), [int(x) for x in running.split(",") if x]


def _array(ids: list[int]) -> str:
    """Transaction ids as an array literal (``{1,2}``), cast to ``xid8[]``."""
    return "{" + ",".join(map(str, ids)) + "}"


def _sqlstate(error: Exception) -> str | None:
    """The SQLSTATE of a ``DatabaseError`` (psycopg's ``sqlstate``,
    psycopg2's ``pgcode``)."""
    cause = error.__cause__ or error
    return getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
