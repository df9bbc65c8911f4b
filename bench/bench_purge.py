"""``outbox_purge`` on a big table of finished rows, and what it costs the
relay running beside it.

Commands (an ``outbox_purge`` database, migrated with ``bench/settings.py``)::

    PG=postgres://postgres@127.0.0.1:5432/outbox_purge
    MARIADB=mysql://root@127.0.0.1:3306/outbox_purge
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_purge --events 10000000
    DATABASE_URL=$MARIADB .venv/bin/python -m bench.bench_purge --events 5000000

1. **Fill**: the outbox tables are emptied (TRUNCATE), then ``--events``
   finished ``OrderPlaced`` events (fanned out, ``occurred_at``/``created_at``
   90 days ago, UUIDv7 ids of that time) and ``--subscribers`` (2) SUCCEEDED
   deliveries each (``completed_at`` 90 days ago) are written by set-based
   SQL, ``--chunk`` events per statement: PostgreSQL ``INSERT ... SELECT`` over
   ``generate_series``, MariaDB over the Sequence engine's ``seq_1_to_N``. No
   row passes through Python. Then ``VACUUM ANALYZE`` / ``ANALYZE TABLE``.
2. **Relay without purge**: ``--relay-events`` (20,000) fresh events are
   published (``outbox_app.publish``, 1,000 per transaction, not fanned out),
   then the real ``python -m django relay --once`` with default settings
   (``bench/settings.py``) and one no-op handler (``BENCH_NOOP_HANDLER=1``)
   fans them out and delivers them; deliveries/s from spawn to exit, process
   start included. ``--rounds`` (3) rounds, the fresh rows deleted between.
3. **Purge**: the real ``python -m django outbox_purge`` with its default
   options (batch size, ``OUTBOX_RETENTION_DAYS`` = 30: every filled row is
   eligible, the relay's fresh rows are not) starts on the big table. Once it
   has begun deleting, the relay rounds run again *while it runs* (the fresh
   backlog published, then ``relay --once``): the ratio of their median to the
   median without purge is the figure (goal >= 0.8x). The purge then runs to
   its end: rows deleted (events + deliveries) per second of its wall time,
   process start and its initial count included.
4. **Lock waits**: every ``--sample`` seconds (0.02) during the purge a
   separate connection records every backend waiting on a lock (PostgreSQL:
   ``pg_stat_activity.wait_event_type = 'Lock'`` with ``pg_blocking_pids``;
   the relay's and the purge's connections are told apart by
   ``application_name``, set through ``PGAPPNAME``. MariaDB:
   ``information_schema.innodb_lock_waits`` joined to ``innodb_trx``, the
   purge's statements recognised by their text), plus the deadlocks counted
   by the server (PostgreSQL ``pg_stat_database.deadlocks``, MariaDB
   ``Innodb_deadlocks``). Reported: samples in which a relay connection waited
   on a lock, and on whom.

``--no-fill`` reuses the rows of an earlier fill (their count is read back);
``--purge-args '--pause-ratio 0'`` passes options to ``outbox_purge``.

Row delivery's figure: the purge of delivery rows and a relay whose fan-out,
claims and marks write rows beside it. This process and the ones it starts
run with ``OUTBOX_ENGINE=rows`` (``bench/settings.py`` reads it from the
environment), whatever the default engine.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
# Row delivery, here and in the relay and purge processes (see above).
os.environ["OUTBOX_ENGINE"] = "rows"

import django

django.setup()

from django.db import connection, connections, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import publish_orders  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VENDOR = connection.vendor
EVENTS = "outbox_app_outboxevent"
DELIVERIES = "outbox_app_delivery"
AGE = datetime.timedelta(days=90)
RELAY_APP = "bench_purge_relay"
PURGE_APP = "bench_purge_purge"


def django_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "django", *args, "--settings", "bench.settings"]


def child_env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BENCH_") and k != "DJANGO_SETTINGS_MODULE"
    }
    return {**env, **extra}


# --- 1. the fill -----------------------------------------------------------------


def execute(sql: str, params: tuple = ()) -> int:
    with connection.cursor() as cursor:
        cursor.execute(sql, params)
        return cursor.rowcount


def empty_tables() -> None:
    if VENDOR == "postgresql":
        execute(
            f"TRUNCATE {DELIVERIES}, {EVENTS}, outbox_app_subscription, "
            "outbox_app_subscriberpause, outbox_app_cursor"
        )
    else:
        execute("SET FOREIGN_KEY_CHECKS = 0")
        for table in (
            DELIVERIES,
            EVENTS,
            "outbox_app_subscription",
            "outbox_app_subscriberpause",
            "outbox_app_cursor",
        ):
            execute(f"TRUNCATE {table}")
        execute("SET FOREIGN_KEY_CHECKS = 1")


def analyze() -> None:
    for table in (EVENTS, DELIVERIES):
        if VENDOR == "postgresql":
            execute(f"VACUUM ANALYZE {table}")
        else:
            with connection.cursor() as cursor:
                cursor.execute(f"ANALYZE TABLE {table}")
                cursor.fetchall()


def fill(events: int, subscribers: int, chunk: int) -> None:
    """``events`` finished events and ``subscribers`` SUCCEEDED deliveries
    each, 90 days old, by set-based INSERT ... SELECT."""
    base = timezone.now() - AGE
    base_ms = int(base.timestamp() * 1000)
    subs = [f"old.subscriber{k}" for k in range(subscribers)]
    if VENDOR == "postgresql":
        series = "generate_series(%s, %s) AS g(i)"
        i = "g.i"
        uuid = (
            f"(lpad(to_hex({base_ms} + {i}), 12, '0') || '7' || "
            f"substr(md5({i}::text), 1, 3) || '8' || "
            f"substr(md5({i}::text), 4, 15))::uuid"
        )
        at = f"to_timestamp(({base_ms} + {i}) / 1000.0)"
        done_at = f"to_timestamp(({base_ms} + {i}) / 1000.0 + 1)"
        payload = (
            f"jsonb_build_object('order_id', {i}, 'total', "
            f"(({i} %% 10000) / 100.0)::text)"
        )
        headers = "'{}'::jsonb"
        subs_sql = "(VALUES " + ", ".join(f"('{s}')" for s in subs) + ") AS s(sub)"
        aggregate_id = f"{i}::text"
    else:
        series = "seq_1_to_%s AS g"
        i = "g.seq"
        uuid = (
            f"LOWER(CONCAT(LPAD(HEX({base_ms} + {i}), 12, '0'), '7', "
            f"SUBSTR(MD5({i}), 1, 3), '8', SUBSTR(MD5({i}), 4, 15)))"
        )
        at = f"FROM_UNIXTIME(({base_ms} + {i}) / 1000.0)"
        done_at = f"FROM_UNIXTIME(({base_ms} + {i}) / 1000.0 + 1)"
        payload = (
            f"JSON_OBJECT('order_id', {i}, 'total', "
            f"CAST(({i} MOD 10000) / 100.0 AS CHAR))"
        )
        headers = "'{}'"
        subs_sql = (
            "(" + " UNION ALL ".join(f"SELECT '{s}' AS sub" for s in subs) + ") AS s"
        )
        aggregate_id = f"CAST({i} AS CHAR)"
    event_sql = (
        f"INSERT INTO {EVENTS} (id, namespace, event_type, revision, "
        "aggregate_type, aggregate_id, aggregate_version, payload, headers, "
        "tenant_id, action_id, action_name, action_params, occurred_at, "
        "created_at, fanned_out) "
        f"SELECT {uuid}, 'bench', 'OrderPlaced', 1, 'bench.Order', {aggregate_id}, "
        f"1, {payload}, {headers}, NULL, NULL, NULL, NULL, {at}, {at}, TRUE "
        f"FROM {series}"
    )
    delivery_sql = (
        f"INSERT INTO {DELIVERIES} (event_id, subscriber, event_type, "
        "aggregate_type, aggregate_id, aggregate_version, tenant_id, state, "
        "attempts, next_retry_at, locked_until, locked_by, lease_token, "
        "last_error, last_error_type, last_traceback, first_failed_at, "
        "completed_at, created_at, updated_at) "
        f"SELECT {uuid}, s.sub, 'OrderPlaced', 'bench.Order', {aggregate_id}, 1, "
        f"NULL, 'SUCCEEDED', 1, {at}, NULL, '', NULL, '', '', '', NULL, "
        f"{done_at}, {at}, {done_at} FROM {series} CROSS JOIN {subs_sql} "
        f"ORDER BY {i}, s.sub"
    )
    began = time.perf_counter()
    for start in range(1, events + 1, chunk):
        stop = min(events, start + chunk - 1)
        if VENDOR == "postgresql":
            params: tuple = (start, stop)
            where_event, where_delivery = event_sql, delivery_sql
        else:
            # seq_1_to_N with a WHERE: the Sequence engine reads only the range.
            params = (stop,)
            cond = f" WHERE {i} >= {start}"
            where_event = event_sql + cond
            where_delivery = delivery_sql.replace(
                f" ORDER BY {i}", cond + f" ORDER BY {i}"
            )
        with transaction.atomic():
            execute(where_event, params)
            execute(where_delivery, params)
        elapsed = time.perf_counter() - began
        print(
            f"  filled {stop:,} events ({stop * (1 + subscribers):,} rows) "
            f"in {elapsed:.0f} s",
            flush=True,
        )
    began = time.perf_counter()
    analyze()
    print(f"  analyzed in {time.perf_counter() - began:.0f} s", flush=True)


def count_rows() -> tuple[int, int]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {EVENTS}")
        (events,) = cursor.fetchone()
        cursor.execute(f"SELECT COUNT(*) FROM {DELIVERIES}")
        (deliveries,) = cursor.fetchone()
    return events, deliveries


# --- 2. the relay ----------------------------------------------------------------


def fresh_backlog(count: int) -> None:
    """Delete the previous round's fresh rows, publish ``count`` new events (not
    fanned out)."""
    cutoff = timezone.now() - datetime.timedelta(days=1)
    with transaction.atomic():
        execute(f"DELETE FROM {DELIVERIES} WHERE subscriber = %s", ("bench.noop",))
        execute(f"DELETE FROM {EVENTS} WHERE created_at >= %s", (cutoff,))
    publish_orders(count, "bench.FreshOrder")
    if VENDOR == "postgresql":
        for table in (EVENTS, DELIVERIES):
            execute(f"ANALYZE {table}")


def relay_once(expected: int) -> tuple[float, str]:
    """``relay --once`` with defaults and the no-op handler: (deliveries/s from
    spawn to exit, its stderr)."""
    began = time.perf_counter()
    done = subprocess.run(
        django_command("relay", "--once"),
        cwd=ROOT,
        env=child_env(BENCH_NOOP_HANDLER="1", PGAPPNAME=RELAY_APP),
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"relay failed ({done.returncode}):\n{done.stderr}")
    summary = re.search(r"^delivered (\d+)", done.stdout, re.MULTILINE)
    assert summary and int(summary[1]) == expected, done.stdout[-500:]
    return expected / elapsed, done.stderr


# --- 4. lock waits ----------------------------------------------------------------


PG_WAITS = """
SELECT a.pid, a.application_name, a.wait_event, left(a.query, 120),
       (SELECT string_agg(b.application_name || ': ' || left(b.query, 80), ' | ')
          FROM pg_stat_activity b WHERE b.pid = ANY(pg_blocking_pids(a.pid)))
  FROM pg_stat_activity a
 WHERE a.datname = current_database() AND a.wait_event_type = 'Lock'
"""
MARIADB_WAITS = """
SELECT r.trx_mysql_thread_id, LEFT(r.trx_query, 120), LEFT(b.trx_query, 80)
  FROM information_schema.innodb_lock_waits w
  JOIN information_schema.innodb_trx r ON r.trx_id = w.requesting_trx_id
  JOIN information_schema.innodb_trx b ON b.trx_id = w.blocking_trx_id
  JOIN information_schema.processlist p ON p.id = r.trx_mysql_thread_id
 WHERE p.db = DATABASE()
"""


def is_purge_sql(sql: str | None) -> bool:
    """The purge's statements (MariaDB, where connections have no name)."""
    return bool(sql) and (
        sql.lstrip().upper().startswith("DELETE") or "completed_at` <" in sql
    )


def deadlocks() -> int:
    with connection.cursor() as cursor:
        if VENDOR == "postgresql":
            cursor.execute(
                "SELECT deadlocks FROM pg_stat_database "
                "WHERE datname = current_database()"
            )
            return cursor.fetchone()[0]
        cursor.execute("SHOW GLOBAL STATUS LIKE 'Innodb_deadlocks'")
        return int(cursor.fetchone()[1])


class LockSampler(threading.Thread):
    """Samples lock waits on its own connection until stopped."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.stopping = threading.Event()
        self.samples = 0
        self.relay_waits: collections.Counter[str] = collections.Counter()
        self.relay_on_purge = 0
        self.other_waits: collections.Counter[str] = collections.Counter()
        self.relay_active = threading.Event()
        self.samples_during_relay = 0

    def run(self) -> None:
        try:
            with connections["default"].cursor() as cursor:
                while not self.stopping.is_set():
                    self.sample(cursor)
                    time.sleep(self.interval)
        finally:
            connections["default"].close()

    def sample(self, cursor) -> None:
        self.samples += 1
        if self.relay_active.is_set():
            self.samples_during_relay += 1
        if VENDOR == "postgresql":
            cursor.execute(PG_WAITS)
            for _pid, app, event, query, blockers in cursor.fetchall():
                line = f"{app or '?'} waits ({event}) in {query!r} on {blockers!r}"
                if app == RELAY_APP:
                    self.relay_waits[line] += 1
                    self.relay_on_purge += PURGE_APP in (blockers or "")
                else:
                    self.other_waits[line] += 1
        else:
            cursor.execute(MARIADB_WAITS)
            for _thread, query, blocker in cursor.fetchall():
                line = f"waits in {query!r} on {blocker!r}"
                if is_purge_sql(query):
                    self.other_waits[line] += 1
                else:
                    self.relay_waits[line] += 1
                    self.relay_on_purge += is_purge_sql(blocker)


# --- the run ------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--subscribers", type=int, default=2)
    parser.add_argument("--chunk", type=int, default=500_000)
    parser.add_argument("--relay-events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sample", type=float, default=0.02)
    parser.add_argument("--no-fill", action="store_true")
    parser.add_argument(
        "--purge-args",
        default="",
        help="extra options of outbox_purge, e.g. '--pause-ratio 0'",
    )
    args = parser.parse_args()

    print(f"{VENDOR}: {connection.settings_dict['NAME']}, row delivery", flush=True)
    if not args.no_fill:
        empty_tables()
        began = time.perf_counter()
        fill(args.events, args.subscribers, args.chunk)
        took = time.perf_counter() - began
        rows = args.events * (1 + args.subscribers)
        print(f"fill: {rows:,} rows in {took:.0f} s ({rows / took:,.0f} rows/s)")
    events, deliveries = count_rows()
    print(f"table: {events:,} events, {deliveries:,} deliveries", flush=True)

    # 2. the relay without purge
    without = []
    for _ in range(args.rounds):
        fresh_backlog(args.relay_events)
        rate, _err = relay_once(args.relay_events)
        without.append(rate)
        print(f"  relay without purge: {rate:,.0f}/s", flush=True)

    # 3. + 4. the purge, the relay beside it, the lock waits
    fresh_backlog(args.relay_events)
    dead_before = deadlocks()
    sampler = LockSampler(args.sample)
    sampler.start()
    log = tempfile.TemporaryFile("w+")  # noqa: SIM115
    began = time.perf_counter()
    purge = subprocess.Popen(
        django_command("outbox_purge", *args.purge_args.split()),
        cwd=ROOT,
        env=child_env(PGAPPNAME=PURGE_APP, PYTHONUNBUFFERED="1"),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # Wait until it deletes: its first progress line follows the initial count.
    while purge.poll() is None:
        log.seek(0)
        if "purged" in log.read():
            break
        time.sleep(0.1)
    started_deleting = time.perf_counter() - began
    print(f"  purge: counted in {started_deleting:.1f} s, deleting", flush=True)
    time.sleep(2)
    during = []
    valid = []
    relay_errors = []
    for k in range(args.rounds):
        if k:
            fresh_backlog(args.relay_events)
        sampler.relay_active.set()
        rate, err = relay_once(args.relay_events)
        sampler.relay_active.clear()
        still = purge.poll() is None
        during.append(rate)
        valid.append(still)
        if "Deadlock" in err or "deadlock" in err or "Lock wait" in err:
            relay_errors.append(err[-500:])
        print(
            f"  relay during purge: {rate:,.0f}/s"
            + ("" if still else " (the purge had ended: not counted)"),
            flush=True,
        )
    purge.wait()
    seconds = time.perf_counter() - began
    sampler.stopping.set()
    sampler.join()
    dead_after = deadlocks()
    log.seek(0)
    output = log.read()
    log.close()
    if purge.returncode:
        raise SystemExit(f"outbox_purge failed ({purge.returncode}):\n{output}")
    summary = re.search(
        r"Deleted (\d+) events?, (\d+) deliver(?:y|ies), (\d+) sentinel rows? and "
        r"(\d+) inbox messages?",
        output,
    )
    assert summary, output[-1000:]
    deleted = sum(int(n) for n in summary.groups())

    # After the purge: the relay on the small table (for the record).
    fresh_backlog(args.relay_events)
    after, _err = relay_once(args.relay_events)

    base = statistics.median(without)
    counted = [r for r, ok in zip(during, valid, strict=True) if ok]
    beside = statistics.median(counted) if counted else float("nan")
    print()
    print(f"rows before the purge: {events:,} events + {deliveries:,} deliveries")
    print(
        f"outbox_purge: {summary[0]} in {seconds:.1f} s = {deleted / seconds:,.0f} "
        f"rows/s (its initial count: {started_deleting:.1f} s)"
    )
    print(
        f"relay --once, {args.relay_events:,} events, no-op handler: "
        f"without purge {base:,.0f}/s (median of {without}), "
        f"during purge {beside:,.0f}/s (median of {len(counted)} rounds), "
        f"ratio {beside / base:.2f}x (goal >= 0.8x); "
        f"after the purge {after:,.0f}/s"
    )
    print(
        f"lock samples: {sampler.samples} every {args.sample} s "
        f"({sampler.samples_during_relay} while a relay ran); "
        f"relay waiting on a lock in {sum(sampler.relay_waits.values())} "
        f"(on the purge: {sampler.relay_on_purge}), "
        f"others waiting in {sum(sampler.other_waits.values())}; "
        f"deadlocks during the purge: {dead_after - dead_before}; "
        f"relay errors: {len(relay_errors)}"
    )
    for line, n in sampler.relay_waits.most_common(10):
        print(f"  relay x{n}: {line}")
    for line, n in sampler.other_waits.most_common(5):
        print(f"  other x{n}: {line}")
    for err in relay_errors:
        print(err)


if __name__ == "__main__":
    main()
