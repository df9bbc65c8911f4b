"""Bare delivery loops: the baseline of ``bench_users handlers``.

What a hand-written outbox worker with a no-op handler costs, in batches of
:data:`BATCH` rows, on the database driver directly (no Django, no outbox_app
code), over PENDING rows of ``outbox_app_delivery`` stored under one
subscriber name. One transaction per batch, repeated until a claim comes back
empty; each row's payload is decoded from JSON and passed to a no-op:

PostgreSQL (psycopg)
    ``WITH c AS (UPDATE ... SET state = 'RUNNING', attempts = attempts + 1,
    locked_until, next_retry_at = now() + 60 s WHERE id IN (SELECT id ... WHERE
    subscriber = %s AND state IN ('PENDING', 'FAILED', 'RUNNING') AND
    next_retry_at <= now() ORDER BY next_retry_at, id LIMIT 500 FOR UPDATE
    SKIP LOCKED) RETURNING id, event_id) SELECT c.id, e.payload FROM c JOIN
    outbox_app_outboxevent e ...``; the no-op per row; ``UPDATE ... SET state =
    'SUCCEEDED', completed_at = now() WHERE id = ANY(%s)``; ``COMMIT``.
MariaDB / MySQL (MySQLdb, READ COMMITTED as Django sets it)
    ``SELECT c.id, e.payload FROM outbox_app_delivery c JOIN
    outbox_app_outboxevent e ON e.id = c.event_id WHERE <the same due
    condition> ORDER BY c.next_retry_at, c.id LIMIT 500 FOR UPDATE SKIP
    LOCKED``; ``UPDATE ... SET state = 'RUNNING', attempts = attempts + 1, ...
    WHERE id IN (...)``; the no-op per row; ``UPDATE ... SET state =
    'SUCCEEDED' ... WHERE id IN (...)``; ``COMMIT``.
SQLite (sqlite3, ``BEGIN IMMEDIATE``)
    ``UPDATE ... SET state = 'RUNNING', ... WHERE id IN (SELECT id ... <the due
    condition> ORDER BY next_retry_at, id LIMIT 500) RETURNING id, event_id``;
    ``SELECT id, payload FROM outbox_app_outboxevent WHERE id IN (...)``; the
    no-op per row; ``UPDATE ... SET state = 'SUCCEEDED' ... WHERE id IN
    (...)``; ``COMMIT``. (Not the payload as a subquery of ``RETURNING``:
    SQLite 3.40 plans a correlated subquery there as a full scan of the events,
    never by primary key, which makes a drain quadratic in the backlog.)
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable, Mapping
from typing import Any

from outbox_app.store.lifecycle import CLAIMABLE

BATCH = 500
N, E = "outbox_app_delivery", "outbox_app_outboxevent"
DUE = "state IN ({})".format(", ".join(f"'{state.value}'" for state in CLAIMABLE))

seen = 0


def noop(delivery_id: int, payload: Any) -> None:
    global seen
    seen += 1


def drain(settings: Mapping[str, Any], subscriber: str) -> int:
    """Deliver every due row of ``subscriber`` with the loop of the database
    ``settings`` (a ``DATABASES`` entry) names; returns rows delivered."""
    global seen
    seen = 0
    loops: dict[str, Callable[[Mapping[str, Any], str], int]] = {
        "postgresql": _postgresql,
        "mysql": _mysql,
        "sqlite3": _sqlite,
    }
    done = loops[settings["ENGINE"].rsplit(".", 1)[-1]](settings, subscriber)
    assert seen == done, (seen, done)
    return done


def _postgresql(settings: Mapping[str, Any], subscriber: str) -> int:
    import psycopg

    claim = (
        f"WITH c AS (UPDATE {N} SET state = 'RUNNING', attempts = attempts + 1, "
        "locked_until = now() + interval '60 seconds', "
        "next_retry_at = now() + interval '60 seconds', updated_at = now() "
        f"WHERE id IN (SELECT id FROM {N} WHERE subscriber = %s AND {DUE} "
        "AND next_retry_at <= now() ORDER BY next_retry_at, id LIMIT %s "
        "FOR UPDATE SKIP LOCKED) RETURNING id, event_id) "
        f"SELECT c.id, e.payload FROM c JOIN {E} e ON e.id = c.event_id"
    )
    finish = (
        f"UPDATE {N} SET state = 'SUCCEEDED', completed_at = now(), "
        "locked_until = NULL, updated_at = now() WHERE id = ANY(%s)"
    )
    done = 0
    with psycopg.connect(
        dbname=settings["NAME"],
        user=settings["USER"] or None,
        password=settings["PASSWORD"] or None,
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
    ) as conn:
        while rows := conn.execute(claim, (subscriber, BATCH)).fetchall():
            for delivery_id, payload in rows:  # jsonb: decoded by psycopg
                noop(delivery_id, payload)
            conn.execute(finish, ([r[0] for r in rows],))
            conn.commit()
            done += len(rows)
        conn.commit()
    return done


def _mysql(settings: Mapping[str, Any], subscriber: str) -> int:
    import MySQLdb

    lock = (
        f"SELECT c.id, e.payload FROM {N} c JOIN {E} e ON e.id = c.event_id "
        f"WHERE c.subscriber = %s AND c.{DUE} AND c.next_retry_at <= "
        "UTC_TIMESTAMP(6) ORDER BY c.next_retry_at, c.id LIMIT %s "
        "FOR UPDATE SKIP LOCKED"
    )
    conn = MySQLdb.connect(
        host=settings["HOST"] or "localhost",
        port=int(settings["PORT"] or 3306),
        user=settings["USER"],
        password=settings["PASSWORD"],
        database=settings["NAME"],
        charset="utf8mb4",
    )
    done = 0
    try:
        cursor = conn.cursor()
        cursor.execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        while True:
            cursor.execute(lock, (subscriber, BATCH))
            rows = cursor.fetchall()
            if not rows:
                break
            ids = [r[0] for r in rows]
            marks = ", ".join(["%s"] * len(ids))
            cursor.execute(
                f"UPDATE {N} SET state = 'RUNNING', attempts = attempts + 1, "
                "locked_until = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, "
                "next_retry_at = UTC_TIMESTAMP(6) + INTERVAL 60 SECOND, "
                f"updated_at = UTC_TIMESTAMP(6) WHERE id IN ({marks})",
                ids,
            )
            for delivery_id, payload in rows:
                noop(delivery_id, json.loads(payload))
            cursor.execute(
                f"UPDATE {N} SET state = 'SUCCEEDED', "
                "completed_at = UTC_TIMESTAMP(6), locked_until = NULL, "
                f"updated_at = UTC_TIMESTAMP(6) WHERE id IN ({marks})",
                ids,
            )
            conn.commit()
            done += len(rows)
        conn.commit()
    finally:
        conn.close()
    return done


def _sqlite(settings: Mapping[str, Any], subscriber: str) -> int:
    import sqlite3

    conn = sqlite3.connect(settings["NAME"], isolation_level=None, timeout=20)
    done = 0
    try:
        while True:
            # Django stores datetimes on SQLite as naive UTC text.
            now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
            stamp = now.isoformat(" ", "microseconds")
            lease = (now + datetime.timedelta(seconds=60)).isoformat(
                " ", "microseconds"
            )
            conn.execute("BEGIN IMMEDIATE")
            rows = conn.execute(
                f"UPDATE {N} SET state = 'RUNNING', attempts = attempts + 1, "
                "locked_until = ?, next_retry_at = ?, updated_at = ? "
                f"WHERE id IN (SELECT id FROM {N} WHERE subscriber = ? AND {DUE} "
                "AND next_retry_at <= ? ORDER BY next_retry_at, id LIMIT ?) "
                "RETURNING id, event_id",
                (lease, lease, stamp, subscriber, stamp, BATCH),
            ).fetchall()
            if not rows:
                conn.execute("COMMIT")
                break
            events = [r[1] for r in rows]
            payloads = dict(
                conn.execute(
                    f"SELECT id, payload FROM {E} "
                    f"WHERE id IN ({', '.join('?' * len(events))})",
                    events,
                ).fetchall()
            )
            for delivery_id, event_id in rows:
                noop(delivery_id, json.loads(payloads[event_id]))
            ids = [r[0] for r in rows]
            conn.execute(
                f"UPDATE {N} SET state = 'SUCCEEDED', completed_at = ?, "
                "locked_until = NULL, updated_at = ? "
                f"WHERE id IN ({', '.join('?' * len(ids))})",
                (stamp, stamp, *ids),
            )
            conn.execute("COMMIT")
            done += len(rows)
    finally:
        conn.close()
    return done
