"""The ordered claim's plan on PostgreSQL, with and without statistics: the
candidates query as the relay sends it (each NOT EXISTS fenced with
``OFFSET 0``: an index probe per candidate) against the same query unfenced
(PostgreSQL free to make anti-joins of them), same tables, same run.

Command (an ``outbox_plan`` database, migrated with ``bench/settings.py``)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_plan \\
        .venv/bin/python -m bench.bench_ordered_plan

For each shape (``rows`` PENDING deliveries of one ordered subscriber,
``per`` events per aggregate, so ``rows / per`` aggregate heads are
claimable), the tables are refilled by set-based SQL and *not analyzed*
(``pg_class.reltuples = -1``, no ``pg_statistic`` rows: a fresh table before
autovacuum's first pass); both queries run once to warm the cache, then
``--repeat`` times each (median); then ``ANALYZE``, and both again. Printed:
milliseconds per claim query and unfenced / fenced; a query over ``--limit``
seconds (30) is cancelled and shown as ``inf``. ``--shapes ROWSxPER,...``
replaces the shapes (default ``8000x4,8000x1,100000x2000,100000x1``).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

from django.db import OperationalError, connection  # noqa: E402
from django.utils import timezone  # noqa: E402

from outbox_app.store.sql import dialect  # noqa: E402

SHAPES = [(8_000, 4), (8_000, 1), (100_000, 2_000), (100_000, 1)]
SUBSCRIBER = "bench.ordered"


def shapes(text: str) -> list[tuple[int, int]]:
    """``"8000x4,100000x1"`` -> ``[(8000, 4), (100000, 1)]``."""
    return [
        (int(rows), int(per))
        for rows, per in (shape.split("x") for shape in text.split(","))
    ]


def fill(rows: int, per: int) -> None:
    aggregates = max(1, rows // per)
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE outbox_app_delivery, outbox_app_outboxevent")
        # TRUNCATE resets the row counts, not the column statistics: drop
        # those too (superuser), so "none" is a table never analyzed.
        cursor.execute(
            "DELETE FROM pg_statistic WHERE starelid IN "
            "('outbox_app_delivery'::regclass, 'outbox_app_outboxevent'::regclass)"
        )
        cursor.execute(
            "INSERT INTO outbox_app_outboxevent (id, namespace, event_type, "
            "revision, aggregate_type, aggregate_id, aggregate_version, payload, "
            "headers, occurred_at, created_at, fanned_out) "
            "SELECT (lpad(to_hex(1700000000000 + i), 12, '0') || '7' || "
            "substr(md5(i::text), 1, 3) || '8' || substr(md5(i::text), 4, 15))::uuid, "
            "'bench', 'OrderPlaced', 1, 'bench.Order', (i %% %s)::text, NULL, "
            "'{}'::jsonb, '{}'::jsonb, now(), now(), TRUE "
            "FROM generate_series(1, %s) AS g(i)",
            [aggregates, rows],
        )
        cursor.execute(
            "INSERT INTO outbox_app_delivery (event_id, subscriber, event_type, "
            "aggregate_type, aggregate_id, aggregate_version, position, state, "
            "attempts, next_retry_at, locked_by, last_error, last_error_type, "
            "last_traceback, created_at, updated_at) "
            "SELECT id, %s, event_type, aggregate_type, aggregate_id, "
            "aggregate_version, position, 'PENDING', 0, created_at, '', '', '', '', "
            "now(), now() "
            "FROM outbox_app_outboxevent",
            [SUBSCRIBER],
        )


def timed(sql: str, repeat: int, limit_seconds: float) -> float:
    """Median milliseconds of ``sql``; ``inf`` when a run exceeds the limit
    (``statement_timeout``: a pathological plan can take hours)."""
    params = [SUBSCRIBER, timezone.now(), "OrderPlaced", 500]
    times = []
    with connection.cursor() as cursor:
        cursor.execute(f"SET statement_timeout = {int(limit_seconds * 1000)}")
        try:
            for _ in range(repeat):
                began = time.perf_counter()
                try:
                    cursor.execute(sql, params)
                except OperationalError:  # canceled by statement_timeout
                    return math.inf
                cursor.fetchall()
                times.append(time.perf_counter() - began)
        finally:
            cursor.execute("SET statement_timeout = 0")
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--limit", type=float, default=30.0, help="seconds")
    parser.add_argument(
        "--shapes",
        type=shapes,
        default=SHAPES,
        help="rows x events per aggregate, e.g. 8000x4,100000x1",
    )
    args = parser.parse_args()
    assert connection.vendor == "postgresql", "a PostgreSQL planner benchmark"
    fenced = dialect("default")._candidates(1, True, 1)
    unfenced = fenced.replace(" OFFSET 0)", ")")
    assert fenced.count(" OFFSET 0)") == 2 and "OFFSET" not in unfenced
    print(
        f"{'rows':>8} {'per agg':>7} {'stats':>9} {'fenced ms':>10} "
        f"{'unfenced ms':>12} {'ratio':>7}"
    )
    for rows, per in args.shapes:
        fill(rows, per)
        for stats in ("none", "analyzed"):
            if stats == "analyzed":
                with connection.cursor() as cursor:
                    cursor.execute("ANALYZE outbox_app_delivery")
                    cursor.execute("ANALYZE outbox_app_outboxevent")
            limit = args.limit
            timed(fenced, 1, limit), timed(unfenced, 1, limit)  # warm the cache
            a = timed(fenced, args.repeat, limit)
            b = timed(unfenced, args.repeat, limit)
            print(
                f"{rows:>8,} {per:>7,} {stats:>9} {a:>10.1f} {b:>12.1f} {b / a:>6.1f}x"
            )
    with connection.cursor() as cursor:
        cursor.execute("TRUNCATE outbox_app_delivery, outbox_app_outboxevent")


if __name__ == "__main__":
    main()
