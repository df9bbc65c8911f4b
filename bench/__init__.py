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


def summarize(
    medians: dict[str, float],
    base: float,
    *,
    column: str,
    unit: str,
    title: str,
    plot: str | None,
) -> None:
    """Print each variant's median and its ratio to ``base``; with ``plot``,
    save the medians as ``bench/<plot>.png``."""
    width = max(len(column), *map(len, medians)) + 2
    print(f"{column:<{width}}{unit + ' (median)':>24}{'ratio':>10}")
    for name, rate in medians.items():
        print(f"{name:<{width}}{rate:>24,.0f}{rate / base:>9.2f}x")
    if plot:
        from bench.plot import bars

        path = bars(
            plot,
            title,
            f"{unit} (median)",
            list(medians),
            {unit: list(medians.values())},
        )
        print(f"plot: {path}")
