"""MySQL 8 and MariaDB 10.6+: no writable CTE and no ``UPDATE ...
RETURNING``, so a claim is three statements in one transaction; ``INSERT
IGNORE``, multi-table ``UPDATE ... JOIN``, ``AUTO_INCREMENT`` positions,
composite indexes where the others have partial ones, the driver's error
numbers, and no snapshot functions: stream delivery reads events numbered in
commit order by the relays."""

from __future__ import annotations

import functools
import re

from django.db import models

from .base import PRIMARY_KEY, Dialect


class MySQLDialect(Dialect):
    vendor = "mysql"
    clock_sql = "SELECT UTC_TIMESTAMP(6)"
    insert_ignore = ("INSERT IGNORE INTO", "")
    stream = "numbered"

    # --- the schema ----------------------------------------------------------------

    def position_numbering(self, table: str) -> list[str]:
        """``AUTO_INCREMENT``, allowed on a column that leads an index (its
        unique index)."""
        t = self.quote(table)
        return [f"ALTER TABLE {t} MODIFY position bigint AUTO_INCREMENT"]

    def update_from(self, table: str, source: str, on: str, columns) -> str:
        """A multi-table ``UPDATE ... JOIN``, the target's columns qualified."""
        assign = ", ".join(f"t.{c} = o.{c}" for c in columns)
        return f"UPDATE {table} t JOIN {source} o ON {on} SET {assign}"

    def json_bytes(self, column: str) -> str:
        return f"COALESCE(LENGTH({column}), 0)"

    def filtered_index(self, index) -> models.Index | None:
        """No partial indexes (Django would drop the condition): a composite
        index led by the columns the condition tests (``fallback_prefix``),
        or none where the index serves only what this database does not do
        (``fallback_prefix`` None: stream delivery's)."""
        if index.fallback_prefix is None:
            return None
        return models.Index(
            fields=[*index.fallback_prefix, *index.fields], name=index.name
        )

    def rename_index(self, table: str, old: str, new: str) -> str | None:
        """A unique constraint is named by its index."""
        return (
            f"ALTER TABLE {self.quote(table)} RENAME INDEX {self.quote(old)} "
            f"TO {self.quote(new)}"
        )

    # --- the driver's errors -----------------------------------------------------

    def violated_constraint(
        self, error: Exception, model: type[models.Model]
    ) -> str | None:
        """The message's ``for key '<name>'`` (``PRIMARY``; MySQL 8 prefixes
        the table)."""
        text = str(error.__cause__ or error)
        key = re.search(r"for key '(?:[^']*\.)?([^'.]+)'", text)
        if key is None:
            return None
        name = key.group(1)
        if name == "PRIMARY":
            return PRIMARY_KEY
        return name if name in self._unique(model) else None

    def deadlocked(self, error: Exception) -> bool:
        """Error 1213 (``ER_LOCK_DEADLOCK``): relays working side by side
        deadlock now and then, InnoDB waiting on index records another relay
        is marking or inserting. The victim is meant to run again ("always be
        prepared to re-issue a transaction if it fails due to deadlock":
        MySQL's InnoDB manual, *How to Minimize and Handle Deadlocks*)."""
        args = getattr(error.__cause__ or error, "args", ())
        return bool(args) and args[0] == 1213

    # InnoDB's lock wait, per session (restored by the caller). 0 gives up at
    # once on MariaDB; MySQL raises it to its minimum, 1 second.
    lock_wait = (
        "SELECT @@SESSION.innodb_lock_wait_timeout",
        "SET SESSION innodb_lock_wait_timeout = %s",
    )
    no_lock_wait = 0

    def gave_up_waiting(self, error: Exception) -> bool:
        """Error 1205 (``ER_LOCK_WAIT_TIMEOUT``): with InnoDB's default
        ``innodb_rollback_on_timeout = OFF`` only the statement is undone."""
        args = getattr(error.__cause__ or error, "args", ())
        return bool(args) and args[0] == 1205

    # --- the relay's statements --------------------------------------------------

    @functools.cache  # noqa: B019 (one instance per database, kept for the process)
    def claim(self, names: int, ordered: bool, types: int | None):
        """Three statements in one transaction, ``(lock, mark(count),
        read(count))``: lock the candidates' ids in claim order within the
        byte budget (``SELECT ... FOR UPDATE SKIP LOCKED``, MySQL 8 ``OF
        c``), mark those rows RUNNING (:meth:`mark`, by primary key), read
        them back with their events (:meth:`read_claimed`)."""
        candidates = self.claim_ids(names, ordered, types if ordered else None)
        return candidates, self.mark, self.read_claimed

    # -- stream delivery: the relays number committed events (a sequencer),
    # -- and a tick is the last number given

    @functools.cached_property
    def sequencer_lock(self) -> str:
        """Lock the sequencer's row unless another relay holds it (``SKIP
        LOCKED``: it is numbering now). Returns ``last`` (no row: held, or
        not created yet). No parameters."""
        return f"SELECT last FROM {self.q} WHERE id = 1 FOR UPDATE SKIP LOCKED"

    @functools.cached_property
    def sequencer_last(self) -> str:
        """The last number given, as committed (no row: none yet). No
        parameters."""
        return f"SELECT last FROM {self.q} WHERE id = 1"

    @functools.cached_property
    def sequencer_create(self) -> str:
        """Create the sequencer's row (left alone when it exists), at the
        highest number an event or a cursor holds: a row created again after
        it was deleted gives no number twice. No parameters."""
        ticks = ", ".join(
            f"CAST(COALESCE({column}, '0') AS SIGNED)"
            for column in ("tick", "next_tick", "stop_tick")
        )
        return (
            f"INSERT IGNORE INTO {self.q} (id, last) SELECT 1, GREATEST("
            f"(SELECT COALESCE(MAX(sequence), 0) FROM {self.e}), "
            f"(SELECT COALESCE(MAX(GREATEST({ticks})), 0) FROM {self.c}))"
        )

    @functools.cached_property
    def unnumbered(self) -> str:
        """Lock the committed events written for stream delivery that have
        no number yet, in position order (``SKIP LOCKED``: an event whose
        transaction is still open is skipped, and numbered once it
        committed). Parameters: the limit. Returns their positions."""
        return (
            f"SELECT position FROM {self.e} WHERE sequence = 0 "
            "AND fanned_out IS NULL ORDER BY position LIMIT %s "
            "FOR UPDATE SKIP LOCKED"
        )

    @functools.cache  # noqa: B019
    def number(self, count: int) -> str:
        """Give ``count`` locked events (by position) their numbers: the
        position plus an offset, so they follow one another as the positions
        do (the numbers may leave gaps: a tick reads a range of them). An
        arithmetic update of a fixed-size column: a number per event picked
        by ``CASE`` cost half again as much. Parameters: the offset, then
        the positions."""
        return (
            f"UPDATE {self.e} SET sequence = position + %s "
            f"WHERE {self.in_list('position', count)}"
        )

    @functools.cached_property
    def sequenced(self) -> str:
        """Record the last number given. Parameters: it."""
        return f"UPDATE {self.q} SET last = %s WHERE id = 1"

    def current_tick(self, cursor) -> str:
        """The last number given, as committed: every event numbered up to it
        has committed (the numbers commit in order, with the sequencer's
        row)."""
        cursor.execute(self.sequencer_last)
        row = cursor.fetchone()
        return str(row[0] if row else 0)

    def _in_tick(self, walk: bool) -> str:
        return "e.sequence > %s AND e.sequence <= %s"

    def tick_params(self, prev: str, cur: str, walk: bool) -> list:
        return [int(prev), int(cur)]

    def partition_hash(self, alias: str) -> str:
        """``CRC32`` of ``<aggregate type>:<aggregate id>`` (the event id, as
        text, without an aggregate): unsigned, 32 bits. (MariaDB 10.7+ keeps
        the id as its ``UUID`` type: uncast, ``COALESCE`` would turn the
        text into one.)"""
        return (
            f"CRC32(COALESCE(CONCAT({alias}.aggregate_type, ':', "
            f"{alias}.aggregate_id), CAST({alias}.id AS CHAR)))"
        )

    #: A tick before every number: a cursor starting there reads every
    #: event kept.
    EMPTY_TICK = "0"

    def _after_origin(self, e: str) -> str:
        return f"({e}.sequence = 0 OR {e}.sequence > {_number('c.first_tick')})"

    def cursor_passed(self, e: str = "e") -> str:
        """Never an event without a number yet."""
        return (
            f"({e}.sequence > 0 AND ({e}.sequence <= {_number('c.tick')} "
            f"OR (c.next_tick IS NOT NULL AND {e}.sequence <= "
            f"{_number('c.next_tick')} AND {e}.position <= c.position)))"
        )

    def unread_hint(self, e: str = "e") -> str:
        return f"({e}.sequence = 0 OR {e}.sequence > {_number('c.tick')})"


def _number(column: str) -> str:
    """A cursor's tick (text) as the number it is."""
    return f"CAST({column} AS SIGNED)"
