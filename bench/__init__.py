"""Benchmarks: each measures outbox_app against a baseline in the same run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_claim_ahead() -> Iterator[None]:
    """The relay as it was before claiming the next batch ahead: one batch at a
    time on one connection (to show what the overlap buys)."""
    from outbox_app.relay import _ClaimAhead

    submit = _ClaimAhead.submit
    _ClaimAhead.submit = lambda self, subscriber, claim: None
    try:
        yield
    finally:
        _ClaimAhead.submit = submit


def vacuum() -> None:
    """On PostgreSQL, VACUUM ANALYZE the outbox tables: each round deletes and
    re-creates 100,000 rows, faster than autovacuum catches up, and the dead
    rows would slow every later round (1.1 million were seen)."""
    from django.db import connection

    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            for table in ("outbox_app_outboxevent", "outbox_app_notification"):
                cursor.execute(f"VACUUM ANALYZE {table}")
