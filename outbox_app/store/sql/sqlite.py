"""SQLite: one writer at a time (one relay per database file, no row locks to
skip), ``UPDATE ... RETURNING`` without joins (3.35+), positions numbered in
publish's INSERT, and the process's own clock."""

from __future__ import annotations

import functools
import re

from django.db import connections, models

from ..tables import Tables
from .base import CLAIM_ASSIGN, PRIMARY_KEY, Dialect


class SQLiteDialect(Dialect):
    vendor = "sqlite"
    single_writer = True
    stream = "position"

    def __init__(self, alias: str, tables: Tables):
        super().__init__(alias, tables)
        version = connections[alias].Database.sqlite_version_info
        self.update_returning = version >= (3, 35)

    # --- publish's INSERT and the schema -------------------------------------------

    def positions(self, table: str, count: int) -> list[str] | None:
        """Numbered in the INSERT, which saves the trigger's UPDATE per row:
        the writers are serialised, so ``MAX() + n`` is free."""
        return [
            f"(SELECT COALESCE(MAX(position), 0) + {n} FROM {table})"
            for n in range(1, count + 1)
        ]

    def position_numbering(self, table: str) -> list[str]:
        """A trigger taking ``MAX(position) + 1`` after each row (the writers
        are serialised, so no two take the same number). SQLite loses a
        table's triggers when Django rebuilds the table (most ``AlterField``
        operations): a migration that rebuilds it numbers again."""
        t, trigger = self.quote(table), self.quote(f"{table}_position")
        return [
            f"DROP TRIGGER IF EXISTS {trigger}",
            f"CREATE TRIGGER {trigger} AFTER INSERT ON {t} FOR EACH ROW "
            f"WHEN NEW.position IS NULL BEGIN UPDATE {t} SET position = "
            f"(SELECT COALESCE(MAX(position), 0) + 1 FROM {t}) "
            "WHERE rowid = NEW.rowid; END",
        ]

    # --- the driver's errors -----------------------------------------------------

    def violated_constraint(
        self, error: Exception, model: type[models.Model]
    ) -> str | None:
        """``UNIQUE constraint failed: <table>.<column>, ...``, matched to the
        constraint on those columns."""
        text = str(error.__cause__ or error)
        failed = re.fullmatch(r"UNIQUE constraint failed: (.+)", text.strip())
        if failed is None:
            return None
        columns = tuple(
            c.strip().rsplit(".", 1)[-1] for c in failed.group(1).split(",")
        )
        if columns == (model._meta.pk.column,):
            return PRIMARY_KEY
        for name, constrained in self._unique(model).items():
            if columns == constrained:
                return name
        return None

    # --- the relay's statements --------------------------------------------------

    @functools.cache  # noqa: B019 (one instance per database, kept for the process)
    def claim(self, names: int, ordered: bool, types: int | None):
        """``(claim, read(count))``: ``UPDATE ... RETURNING id`` of the
        candidates, then the rows read by primary key (:meth:`read_claimed`).
        RETURNING may not join, and scalar subqueries there (one per event
        column) scan the events table for every row. Before SQLite 3.35,
        ``(candidates, mark(count), read(count))`` in one transaction."""
        candidates = self.claim_ids(names, ordered, types if ordered else None)
        if not self.update_returning:
            return candidates, self.mark, self.read_claimed
        claim = (
            f"UPDATE {self.n} SET {CLAIM_ASSIGN} WHERE id IN ({candidates}) "
            "RETURNING id"
        )
        return claim, self.read_claimed

    # -- stream delivery: one writer at a time numbers positions in commit
    # -- order, so a cursor is the last position read

    def _in_tick(self, walk: bool) -> str:
        return "1 = 1"

    def partition_hash(self, alias: str) -> str:
        """One relay per database file: one partition (the check refuses
        more), so every event hashes to 0."""
        return "0"

    def first_reading(self, using: str, earliest: bool) -> tuple[str | None, int]:
        if earliest:
            return None, 0
        with connections[using].cursor() as cursor:
            cursor.execute(f"SELECT COALESCE(MAX(position), 0) FROM {self.e}")
            return None, cursor.fetchone()[0]

    def _after_origin(self, e: str) -> str:
        return f"{e}.position > COALESCE(c.first_position, 0)"

    def cursor_passed(self, e: str = "e") -> str:
        return f"{e}.position <= COALESCE(c.position, 0)"

    def unread_hint(self, e: str = "e") -> str:
        return f"{e}.position > COALESCE(c.position, 0)"
