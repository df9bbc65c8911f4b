"""How the databases differ, in one package laid out as Django's own backends:
``base.py`` holds what they share (:class:`~.base.Dialect`: the relay's
statements, values across the DB-API, the driver's errors, the schema's
special parts) and one module per database holds what differs there
(``postgresql.py``, ``mysql.py`` for MySQL and MariaDB, ``sqlite.py``).

:func:`dialect` chooses a database alias's class once and gives it the
outbox's tables by name (:class:`~outbox_app.store.tables.Tables`, read from
the models: this package imports none of them); the rest of the app asks
it, never which database it is on.
"""

from __future__ import annotations

import functools

from django.db import connections

from ...exceptions import UnsupportedDatabase
from ..tables import Tables
from .base import PRIMARY_KEY, Dialect
from .mysql import MySQLDialect
from .postgresql import PostgreSQLDialect
from .sqlite import SQLiteDialect

__all__ = [
    "DIALECTS",
    "PRIMARY_KEY",
    "Dialect",
    "dialect",
    "dialect_if_supported",
    "dialect_of",
]

#: The :class:`Dialect` of each ``connection.vendor`` outbox_app runs on.
DIALECTS: dict[str, type[Dialect]] = {
    cls.vendor: cls for cls in (PostgreSQLDialect, MySQLDialect, SQLiteDialect)
}


def dialect(alias: str) -> Dialect:
    """The :class:`Dialect` of database ``alias`` (looked up per call: cheap,
    and right in every thread, whose connections are their own; built once
    per alias and vendor).

    Raises:
        UnsupportedDatabase: the alias's database is none of PostgreSQL,
            MySQL/MariaDB and SQLite.
    """
    return _dialect(alias, connections[alias].vendor)


def dialect_if_supported(alias: str) -> Dialect | None:
    """:func:`dialect` of ``alias``, or None where outbox_app has no dialect
    for its database (what a system check leaves alone)."""
    try:
        return dialect(alias)
    except UnsupportedDatabase:
        return None


def dialect_of(connection) -> Dialect:
    """The :class:`Dialect` of ``connection`` (a Django connection, e.g. a
    schema editor's): :func:`dialect` of its alias, with no lookup.

    Raises:
        UnsupportedDatabase: as :func:`dialect`.
    """
    return _dialect(connection.alias, connection.vendor)


@functools.cache
def _dialect(alias: str, vendor: str) -> Dialect:
    try:
        cls = DIALECTS[vendor]
    except KeyError:
        raise UnsupportedDatabase(
            f"database {alias!r} is {vendor}; outbox_app runs on PostgreSQL, "
            "MySQL/MariaDB and SQLite"
        ) from None
    return cls(alias, Tables.of_models())
