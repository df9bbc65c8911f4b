"""The one place that knows how the databases differ.

Everything here asks ``connection.features`` (or the vendor, for the two things
no feature flag names: SQLite's single-writer file and PostgreSQL's
LISTEN/NOTIFY) and gives the rest of the app one portable operation.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from django.db import connections, models
from django.db.models import Q, QuerySet

from .exceptions import RelayAlreadyRunning


class FilteredIndex(models.Index):
    """A partial index where the database has them (PostgreSQL, SQLite); elsewhere
    (MySQL/MariaDB, where Django would drop the condition) a composite index led
    by ``fallback_prefix``, the columns the condition tests.

    One migration serves all three databases (Ekbatan's schema notes, seed 000).
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
        return "outbox_app.db.FilteredIndex", args, kwargs

    def _concrete(self, connection) -> models.Index:
        if connection.features.supports_partial_indexes:
            return models.Index(fields=self.fields, name=self.name, condition=self.when)
        return models.Index(
            fields=[*self.fallback_prefix, *self.fields], name=self.name
        )

    def create_sql(self, model, schema_editor, using="", **kwargs):
        concrete = self._concrete(schema_editor.connection)
        return concrete.create_sql(model, schema_editor, using=using, **kwargs)


def has_skip_locked(alias: str) -> bool:
    """True where several relays can claim rows side by side (PostgreSQL, MySQL 8,
    MariaDB 10.6+)."""
    return connections[alias].features.has_select_for_update_skip_locked


def lock_skipping_locked(queryset: QuerySet) -> QuerySet:
    """``select_for_update(skip_locked=True)`` where supported, locking only the
    queryset's own table; a no-op on SQLite, whose writers are serialised."""
    features = connections[queryset.db].features
    if not features.has_select_for_update:
        return queryset
    of = ("self",) if features.has_select_for_update_of else ()
    return queryset.select_for_update(skip_locked=True, of=of)


def lock_waiting(queryset: QuerySet) -> QuerySet:
    """``select_for_update()`` that waits for other lockers; a no-op on SQLite."""
    if not connections[queryset.db].features.has_select_for_update:
        return queryset
    return queryset.select_for_update()


def is_single_writer(alias: str) -> bool:
    """True for SQLite: one relay process per database file."""
    return connections[alias].vendor == "sqlite"


@contextmanager
def single_relay_guard(alias: str) -> Iterator[None]:
    """Hold an exclusive lock for the life of a relay on a SQLite database.

    Elsewhere it does nothing: skip-locked claims let relays run side by side.
    The lock is an ``flock`` on ``<database file>.relay.lock``, released by the
    kernel when the process exits, even on SIGKILL.

    Raises:
        RelayAlreadyRunning: another process holds the lock for this file.
    """
    if not is_single_writer(alias):
        yield
        return
    name = str(connections[alias].settings_dict["NAME"])
    if name == ":memory:" or name.startswith("file:"):
        yield
        return
    path = f"{name}.relay.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RelayAlreadyRunning(
                f"Another relay is already running on the SQLite database {name}. "
                "SQLite supports one relay process per database file; stop the "
                "other one, or use PostgreSQL or MySQL/MariaDB to run several."
            ) from None
        yield
    finally:
        os.close(fd)
