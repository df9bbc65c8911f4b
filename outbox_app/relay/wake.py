"""Waking relays: a PostgreSQL ``NOTIFY`` after each commit that published
events, and the :class:`Listener` a relay waits on between polls. (The Celery
relay task's wake-up, ``OUTBOX_CELERY_WAKE``, is ``tasks.wake``.)"""

from __future__ import annotations

import logging
import threading
from typing import Any

from django.db import connections

from ..store.sql import dialect

logger = logging.getLogger("outbox_app.relay")

#: PostgreSQL channel relays LISTEN on; publishers NOTIFY it after commit.
CHANNEL = "outbox_app"


def notify_relays(alias: str) -> None:
    """Wake relays in other processes now that events committed on ``alias``.

    PostgreSQL: ``NOTIFY outbox_app`` (run from the publisher's on-commit hook, so
    it can only arrive after the commit). Other databases have no such channel:
    relays there poll, adaptively (docs/relay.md).
    """
    if not dialect(alias).notifies:
        return
    with connections[alias].cursor() as cursor:
        cursor.execute(f"NOTIFY {CHANNEL}")


class Listener:
    """Waits for a wake-up: a PostgreSQL delivery on its own autocommit
    connection, or (any database) an in-process :meth:`wake`.

    Usage::

        with Listener("default") as listener:
            reason = listener.wait(1.0)  # "notify", "signal" or None (timed out)
    """

    def __init__(self, alias: str):
        self.alias = alias
        self._woken = threading.Event()
        self._pg = None

    def __enter__(self) -> Listener:
        try:
            self.open()
        except Exception as exc:  # the database is down: poll, reopen later
            logger.warning("relay cannot LISTEN yet, polling meanwhile: %s", exc)
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    @property
    def listens(self) -> bool:
        """True while a PostgreSQL LISTEN connection is open."""
        return self._pg is not None

    def open(self) -> None:
        """(Re)open the LISTEN connection on PostgreSQL; a no-op elsewhere.

        Raises:
            django.db.OperationalError-like driver errors when the database is
            unreachable; the caller retries.
        """
        if not dialect(self.alias).notifies or self._pg is not None:
            return
        connection = connections[self.alias]
        raw = connection.Database.connect(**connection.get_connection_params())
        raw.autocommit = True
        raw.execute(f"LISTEN {CHANNEL}")
        self._pg = raw

    def close(self) -> None:
        if self._pg is not None:
            try:
                self._pg.close()
            finally:
                self._pg = None

    def wake(self, **kwargs: Any) -> None:
        """Wake a waiting :meth:`wait` from this process (a signal receiver)."""
        self._woken.set()

    def wait(self, timeout: float) -> str | None:
        """Block up to ``timeout`` seconds for a wake-up.

        Returns:
            ``"notify"`` (a PostgreSQL NOTIFY), ``"signal"`` (in-process
            wake-up) or ``None`` (timed out). Pending deliveries are drained.

        Raises:
            the driver's connection errors if the LISTEN connection broke; the
            listener is closed and the caller may reopen it.
        """
        if self._woken.is_set():
            self._woken.clear()
            return "signal"
        if self._pg is None:
            woken = self._woken.wait(timeout)
            self._woken.clear()
            return "signal" if woken else None
        try:
            got = any(True for _ in self._pg.notifies(timeout=timeout, stop_after=1))
            if got:
                for _ in self._pg.notifies(timeout=0):  # what has arrived, no wait
                    pass
        except Exception:
            self.close()
            raise
        if self._woken.is_set():
            self._woken.clear()
            return "signal"
        return "notify" if got else None


def wake_relays(sender: Any, using: str, **kwargs: Any) -> None:
    """``events_committed`` receiver: wake relays in other processes (PostgreSQL
    NOTIFY)."""
    notify_relays(using)
