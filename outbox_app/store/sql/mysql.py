"""MySQL 8 and MariaDB 10.6+: no writable CTE and no ``UPDATE ...
RETURNING``, so a claim is three statements in one transaction; ``INSERT
IGNORE``, multi-table ``UPDATE ... JOIN``, ``AUTO_INCREMENT`` positions,
composite indexes where the others have partial ones, and the driver's error
numbers."""

from __future__ import annotations

import functools
import re

from django.db import models

from .base import PRIMARY_KEY, Dialect


class MySQLDialect(Dialect):
    vendor = "mysql"
    clock_sql = "SELECT UTC_TIMESTAMP(6)"
    insert_ignore = ("INSERT IGNORE INTO", "")

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
