"""MariaDB without snapshots: a row per delivery, or events numbered once in
commit order and read by a cursor? Lean loops on the driver, same run.

    .venv/bin/python -m bench.bench_mariadb_order [--events 50000] [--rounds 2]
        [--url mysql://root@127.0.0.1:3306/outbox_bench]

MariaDB has no ``pg_current_snapshot()``, so stream delivery cannot read
"the events committed since the last tick" there. Two designs deliver
without it; this measures what each costs at its floor, hand-written on
MySQLdb (no Django, no outbox_app code: the ceiling of any version of it),
draining ``--events`` events committed beforehand (1,000 a transaction,
~100-byte JSON payloads) to 1 and to 3 subscribers with a no-op handler,
batches of 500, READ COMMITTED, on tables of its own (``bench_order_*``):

* **rows** (outbox_app's row delivery, lean): each batch of events is fanned
  out (``FOR UPDATE SKIP LOCKED``, one delivery row per subscriber,
  ``fanned_out`` set), then each subscriber claims its rows (``FOR UPDATE
  SKIP LOCKED``, RUNNING), calls the handler and marks them SUCCEEDED:
  3 row writes per delivery, 1 per event.
* **numbered**: a sequencer numbers the committed events not numbered yet,
  in id order (``FOR UPDATE SKIP LOCKED``: an uncommitted event is numbered
  once it commits; a counter row held to the commit keeps the numbers
  committed in order), then each subscriber reads the events after its
  cursor by number, calls the handler and moves its cursor: 1 row write per
  event, 1 per batch and subscriber.

Prints events/s (median over rounds) per design and subscriber count, and the
ratio of numbered to rows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.parse

import MySQLdb

BATCH = 500
E, D, C, K = (
    "bench_order_event",
    "bench_order_delivery",
    "bench_order_cursor",
    "bench_order_counter",
)
SCHEMA = [
    f"DROP TABLE IF EXISTS {E}, {D}, {C}, {K}",
    f"CREATE TABLE {E} (id BIGINT AUTO_INCREMENT PRIMARY KEY, seq BIGINT NULL, "
    "fanned_out BOOL NOT NULL DEFAULT FALSE, aggregate VARCHAR(64) NOT NULL, "
    "payload LONGTEXT NOT NULL, KEY (seq), KEY (fanned_out, id)) ENGINE=InnoDB",
    f"CREATE TABLE {D} (id BIGINT AUTO_INCREMENT PRIMARY KEY, event_id BIGINT "
    "NOT NULL, subscriber VARCHAR(64) NOT NULL, state CHAR(1) NOT NULL, "
    "attempts INT NOT NULL DEFAULT 0, completed_at DATETIME(6) NULL, "
    "KEY (subscriber, state, id)) ENGINE=InnoDB",
    f"CREATE TABLE {C} (subscriber VARCHAR(64) PRIMARY KEY, position BIGINT "
    "NOT NULL) ENGINE=InnoDB",
    f"CREATE TABLE {K} (k INT PRIMARY KEY, next BIGINT NOT NULL) ENGINE=InnoDB",
]

seen = 0


def noop(payload) -> None:
    global seen
    seen += 1


def connect(url: str):
    parts = urllib.parse.urlparse(url)
    database = parts.path.lstrip("/")
    conn = MySQLdb.connect(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 3306,
        user=parts.username or "root",
        password=parts.password or "",
        charset="utf8mb4",
        **({"database": database} if database else {}),
    )
    conn.cursor().execute("SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
    return conn


def load(conn, events: int, subscribers: list[str]) -> None:
    cursor = conn.cursor()
    for statement in SCHEMA:
        cursor.execute(statement)
    cursor.execute(f"INSERT INTO {K} VALUES (1, 0)")
    cursor.executemany(f"INSERT INTO {C} VALUES (%s, 0)", [(s,) for s in subscribers])
    for start in range(0, events, 1000):
        rows = [
            (f"order:{i % 997}", json.dumps({"order_id": i, "total": f"{i}.00"}))
            for i in range(start, min(events, start + 1000))
        ]
        cursor.executemany(
            f"INSERT INTO {E} (aggregate, payload) VALUES (%s, %s)", rows
        )
        conn.commit()
    cursor.execute(f"ANALYZE TABLE {E}")
    cursor.fetchall()


def locked(cursor, condition: str) -> list[int]:
    """Lock up to :data:`BATCH` events matching ``condition``, in id order,
    skipping those another transaction holds (one not committed yet
    included); their ids."""
    cursor.execute(
        f"SELECT id FROM {E} WHERE {condition} ORDER BY id LIMIT %s "
        "FOR UPDATE SKIP LOCKED",
        (BATCH,),
    )
    return [r[0] for r in cursor.fetchall()]


def rows(conn, subscribers: list[str]) -> None:
    cursor = conn.cursor()
    while True:
        ids = locked(cursor, "NOT fanned_out")  # fan out a batch of events
        if ids:
            marks = ", ".join(["%s"] * len(ids))
            for name in subscribers:
                cursor.execute(
                    f"INSERT INTO {D} (event_id, subscriber, state) SELECT id, %s, "
                    f"'P' FROM {E} WHERE id IN ({marks})",
                    [name, *ids],
                )
            cursor.execute(
                f"UPDATE {E} SET fanned_out = TRUE WHERE id IN ({marks})", ids
            )
        conn.commit()
        claimed = 0
        for name in subscribers:
            while True:
                cursor.execute(
                    f"SELECT d.id, e.payload FROM {D} d JOIN {E} e ON e.id = "
                    "d.event_id WHERE d.subscriber = %s AND d.state = 'P' "
                    "ORDER BY d.id LIMIT %s FOR UPDATE SKIP LOCKED",
                    (name, BATCH),
                )
                found = cursor.fetchall()
                if not found:
                    break
                claim = [r[0] for r in found]
                marks = ", ".join(["%s"] * len(claim))
                cursor.execute(
                    f"UPDATE {D} SET state = 'R', attempts = attempts + 1 "
                    f"WHERE id IN ({marks})",
                    claim,
                )
                for _, payload in found:
                    noop(json.loads(payload))
                cursor.execute(
                    f"UPDATE {D} SET state = 'S', completed_at = UTC_TIMESTAMP(6) "
                    f"WHERE id IN ({marks})",
                    claim,
                )
                conn.commit()
                claimed += len(found)
        if not ids and not claimed:
            return


def numbered(conn, subscribers: list[str]) -> None:
    cursor = conn.cursor()
    while True:
        # Number the committed events not numbered yet, in id order.
        ids = locked(cursor, "seq IS NULL")
        if ids:
            cursor.execute(f"SELECT next FROM {K} WHERE k = 1 FOR UPDATE")
            first = cursor.fetchone()[0] + 1
            cursor.execute(
                f"UPDATE {E} SET seq = CASE id "
                + " ".join(["WHEN %s THEN %s"] * len(ids))
                + " END WHERE id IN ("
                + ", ".join(["%s"] * len(ids))
                + ")",
                [v for n, i in enumerate(ids) for v in (i, first + n)] + ids,
            )
            cursor.execute(
                f"UPDATE {K} SET next = %s WHERE k = 1", (first + len(ids) - 1,)
            )
        conn.commit()
        read = 0
        for name in subscribers:
            while True:
                cursor.execute(
                    f"SELECT position FROM {C} WHERE subscriber = %s", (name,)
                )
                position = cursor.fetchone()[0]
                cursor.execute(
                    f"SELECT seq, payload FROM {E} WHERE seq > %s "
                    "ORDER BY seq LIMIT %s",
                    (position, BATCH),
                )
                found = cursor.fetchall()
                if not found:
                    conn.commit()
                    break
                for _, payload in found:
                    noop(json.loads(payload))
                cursor.execute(
                    f"UPDATE {C} SET position = %s WHERE subscriber = %s",
                    (found[-1][0], name),
                )
                conn.commit()
                read += len(found)
        if not ids and not read:
            return


def main() -> None:
    global seen
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--url", default="mysql://root@127.0.0.1:3306/outbox_bench")
    args = parser.parse_args()
    setup = connect(urllib.parse.urlparse(args.url)._replace(path="").geturl())
    name = urllib.parse.urlparse(args.url).path.lstrip("/")
    setup.cursor().execute(
        f"CREATE DATABASE IF NOT EXISTS {name} CHARACTER SET utf8mb4"
    )
    setup.close()
    conn = connect(args.url)
    rates: dict[str, list[float]] = {}
    for round_ in range(args.rounds):
        for count in (1, 3):
            subscribers = [f"s{i}" for i in range(count)]
            for design in (rows, numbered):
                load(conn, args.events, subscribers)
                seen = 0
                began = time.perf_counter()
                design(conn, subscribers)
                elapsed = time.perf_counter() - began
                assert seen == args.events * count, (design.__name__, seen)
                key = f"{design.__name__}, {count} subscriber(s)"
                rates.setdefault(key, []).append(args.events / elapsed)
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
            flush=True,
        )
    cursor = conn.cursor()
    cursor.execute("SELECT VERSION()")
    print(
        f"MariaDB {cursor.fetchone()[0]}, {args.events:,} events, batches of "
        f"{BATCH}, {args.rounds} round(s); events/s (median), each event to "
        "every subscriber"
    )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    for key, rate in medians.items():
        print(f"  {key:<28} {rate:>10,.0f}")
    for count in (1, 3):
        ratio = (
            medians[f"numbered, {count} subscriber(s)"]
            / medians[f"rows, {count} subscriber(s)"]
        )
        print(f"numbered / rows, {count} subscriber(s): {ratio:.2f}x")
    for statement in SCHEMA[:1]:
        cursor.execute(statement)
    conn.close()


if __name__ == "__main__":
    main()
