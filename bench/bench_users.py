"""Every figure measured the way users run the product: the real
``python -m django relay`` process of a fresh project with DEFAULT settings
(``bench/settings.py``: only the database, the apps, the namespace and, when a
figure needs one, a RabbitMQ publisher), process start included, against a
baseline measured in the same run. PostgreSQL first; MariaDB and SQLite beside.

Commands (``outbox_bench`` databases: ``createdb -h 127.0.0.1 -U postgres
outbox_bench``; ``mysql -h 127.0.0.1 -uroot -e "CREATE DATABASE outbox_bench
CHARACTER SET utf8mb4"``)::

    PG=postgres://postgres@127.0.0.1:5432/outbox_bench
    MARIADB=mysql://root@127.0.0.1:3306/outbox_bench
    SQLITE=sqlite:////tmp/outbox_bench.sqlite3
    # a) relay --once to RabbitMQ, 20,000 events
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users broker \\
        --events 20000 --plot bench_users_broker_postgresql
    # b) relay --once, one no-op handler, 50,000 events
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users handlers \\
        --events 50000 --plot bench_users_handlers_postgresql
    # c) latency at 200 events/s, 3,000 events per path
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users latency \\
        --events 3000 --plot bench_users_latency_postgresql
    # d) publish() overhead: bench/bench_overhead.py (tests' settings)
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users overhead \\
        --plot bench_overhead_postgresql
    # e) a 300 s RabbitMQ outage under a 5 events/s writer (no baseline)
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users outage --outage 300 \\
        --plot bench_users_outage_postgresql
    # g) 1, 2 and 4 relays on one database, 50,000 events, a no-op handler
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users scaleout
    # f) relay --once beside 200,000 deliveries scheduled for tomorrow
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_users scheduled
    # the same figures beside: DATABASE_URL=$MARIADB ..., DATABASE_URL=$SQLITE ...
    # (plot names ending _mariadb, _sqlite)

Every figure prints the outbox_app figure, its baseline, the ratio and the
goal; medians over ``--rounds`` (default 3) for a) and b). The machine is
noisy: read the ratios. ``--plot NAME`` saves bench/NAME.png.

**a) broker.** ``--events`` ``OrderPlaced`` events published with
``outbox_app.publish`` in transactions of 1,000 and NOT fanned out (fan-out is
the relay's work), then ``relay --once`` with a default ``KombuPublisher``
(``OUTBOX_PUBLISHERS`` from ``$BENCH_PUBLISHERS``: exchange and durable queue
``outbox-bench-users`` bound with ``#``; persistent messages, publisher
confirms), timed from spawn to exit: events/s. A second variant adds
``--batch-size 100`` (the default before it became 500). Baselines in the
same round, on the same events' CloudEvents bodies encoded beforehand, no
database: raw pika (``SelectConnection`` + ``confirm_delivery``) and raw
py-amqp, 1,000 messages in flight (``bench/rabbit.py``). The queue is purged
before each run and holds exactly ``--events`` messages after it. Goal: relay
>= 0.8x raw pika.

**b) handlers.** ``--events`` events published, not fanned out; ``relay
--once`` with one no-op in-process handler (``BENCH_NOOP_HANDLER=1``),
deliveries/s from spawn to exit. Baseline: a bare loop on the database driver
(``bench/bare.py``: psycopg, MySQLdb or sqlite3, no Django) over its own copy
of ``--events`` PENDING delivery rows of the same events (stored under
subscriber ``bench.baseline``): per transaction claim 500 due rows with
``FOR UPDATE SKIP LOCKED`` (PostgreSQL: one ``UPDATE ... RETURNING`` in a CTE
joined to the events' payload; MariaDB: ``SELECT ... FOR UPDATE SKIP LOCKED``
joined to the payload, then ``UPDATE``; SQLite: ``UPDATE ... RETURNING id,
event_id`` then the payloads by id), a no-op per row on the decoded payload,
one ``UPDATE`` to SUCCEEDED, commit; until a claim is empty. Goals: >= 0.5x
the loop and >= 5,000/s.

**c) latency.** ``relay`` (no ``--once``) with defaults in its own process
(PostgreSQL: LISTEN/NOTIFY wake-ups; elsewhere the adaptive poll), warmed up
with a few events; this process then commits one ``publish()`` per transaction
at a steady ``--rate`` (200/s), ``--events`` times, recording ``time.time()``
in an on-commit hook registered before ``publish()``'s own (so right after
COMMIT, before the NOTIFY). Paths: *handler*: ``time.time()`` at the start of
a handler (``BENCH_LATENCY_FILE``); *confirm*: a ``KombuPublisher`` subclass
(``bench.benchapp.publishers.ConfirmTimes``) records the time its ``collect()``
returns the broker's confirms. Baseline (PostgreSQL only): the floor of the
wake-up, commit -> a bare psycopg process blocked in LISTEN on the relays'
channel receives the delivery. Prints p50/p90/p99/max in ms; goals:
handler p50 <= 5 ms and p99 <= 25 ms, confirm p50 <= 8 ms.

**d) publish() overhead** is ``bench/bench_overhead.py`` (publish() of 1 and 5
events in a minimal transaction against a raw INSERT of the same rows); the
``overhead`` subcommand runs it with the arguments given after it.

**f) scheduled.** Does a table full of deliveries scheduled for later slow
the delivery of those due now? ``relay --once`` with the no-op handler over
``--events`` due events, first alone, then after ``--scheduled`` events
published with ``deliver_at`` a day ahead and passed by a first ``relay
--once`` (their PENDING rows sit in the claim's index, due tomorrow: row
delivery fans them out; stream delivery writes a row for each scheduled event
its cursor passes): deliveries/s, the first as the
baseline. A third run has as many events published without a schedule and
delivered before the due ones, so its tables are as big: what size alone
costs. Goal: beside scheduled >= 0.9x beside delivered.

**g) scaleout.** ``--events`` (50,000) events published, not fanned out; 1,
2 and 4 ``relay --once`` processes with default settings started together
(``--to handler``: one no-op handler; ``--to rabbitmq``: the RabbitMQ
publisher of a)), timed from the first spawn to the last exit: deliveries/s,
one relay as the baseline. Goals: 2 relays >= 1.3x one, 4 no slower than 2.
``--running``: the relays are long-running ``relay`` processes started and
idle beforehand (process start out of the figure, as in a deployment); the
events are published and fanned out while an operator pause holds the
subscriber, and the clock runs from the first delivery's SUCCEEDED to the
last, by the database's ``completed_at`` (the relays see the resume within
1 s, a wait, not a rate, that would dominate a run of a few seconds).

**e) outage.** The relay (no ``--once``, defaults) publishes to RabbitMQ
through a loopback TCP proxy (``tests/brokers/proxy.py``); a writer thread publishes
``--rate`` (5) events/s throughout. After ``--before`` seconds the proxy is cut
(connections dropped, new ones refused) for ``--outage`` seconds (300), then
restored. The relay's subscriber is recorded before the relay and the writer
start (``outbox_subscribers --record``), so every event is its. Reports the
events published during the outage, the time from the restore until every
event committed before it is delivered (whichever engine: a SUCCEEDED row,
or read past by the subscriber's cursor with no row), DEAD rows (goal 0),
failed attempts recorded (the attempts of delivery rows beyond each
SUCCEEDED row's one; goal 0: no attempt counted for the outage), duplicates
in the queue, and the relay's log lines about the pause ("paused" /
"resumed"). No baseline.
"""

from __future__ import annotations

import argparse
import datetime
import decimal
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# The relay processes and this one must define the same event class.
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, connections, transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import (  # noqa: E402
    CpuMeter,
    bare,
    context_for,
    engine,
    percentile,
    print_cpu,
    publish_orders,
    rabbit,
    summarize,
    vacuum,
)
from bench.benchapp.events import OrderPlaced  # noqa: E402
from outbox_app import Delivery, OutboxEvent, publish  # noqa: E402
from outbox_app.models import Cursor, SubscriberPause, Subscription  # noqa: E402
from outbox_app.ops.streams import delivered  # noqa: E402
from outbox_app.relay.loop import HELD_REFRESH_SECONDS  # noqa: E402
from outbox_app.store.lifecycle import State  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXCHANGE = QUEUE = "outbox-bench-users"
PUBLISHER = "rabbitmq"
FLOOR = "wake-up floor"
VENDOR = {"postgresql": "PostgreSQL", "mysql": "MariaDB", "sqlite": "SQLite"}[
    connection.vendor
]


# --- the relay process -----------------------------------------------------------


def relay_command(*args: str) -> list[str]:
    """``python -m django relay ARGS`` of the fresh project (cwd: the repo)."""
    return [
        sys.executable,
        "-m",
        "django",
        "relay",
        *args,
        "--settings",
        "bench.settings",
    ]


def child_env(**extra: str) -> dict[str, str]:
    """This environment (``DATABASE_URL`` included), without any ``BENCH_*``
    switch or settings module but those given."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("BENCH_") and k != "DJANGO_SETTINGS_MODULE"
    }
    return {**env, **extra}


def publishers(url: str = rabbit.URL, backend: str | None = None) -> str:
    """``$BENCH_PUBLISHERS``: one KombuPublisher to the benchmark queue."""
    options = {"URL": url, "EXCHANGE": EXCHANGE, "DECLARE": [QUEUE]}
    if backend:
        options["BACKEND"] = backend
    return json.dumps({PUBLISHER: options})


def spawn_relay(*args: str, quiet: bool = False, **env: str) -> subprocess.Popen:
    """Start ``python -m django relay ARGS`` of the fresh project with
    ``env`` (see :func:`child_env`); its output piped, as text, or
    discarded (``quiet``: a relay that runs until stopped, whose log nobody
    reads, must not fill a pipe)."""
    output = subprocess.DEVNULL if quiet else subprocess.PIPE
    return subprocess.Popen(
        relay_command(*args),
        cwd=ROOT,
        env=child_env(**env),
        stdout=output,
        stderr=output,
        text=True,
    )


def relay_once(expected: int, *args: str, **env: str) -> float:
    """Run ``relay --once ARGS`` to its exit; seconds from spawn to exit.
    Checks that it delivered ``expected`` deliveries."""
    began = time.perf_counter()
    done = subprocess.run(
        relay_command("--once", *args),
        cwd=ROOT,
        env=child_env(**env),
        capture_output=True,
        text=True,
    )
    elapsed = time.perf_counter() - began
    if done.returncode:
        raise SystemExit(f"relay failed ({done.returncode}):\n{done.stderr}")
    summary = re.search(r"^delivered (\d+).*", done.stdout, re.MULTILINE)
    assert summary and int(summary[1]) == expected, done.stdout[-500:]
    return elapsed


def start_up(**env: str) -> float:
    """Seconds of ``relay --once`` over empty tables: process start, Django
    set-up, connections, one empty iteration (part of every figure)."""
    reset()
    return relay_once(0, **env)


# --- the data --------------------------------------------------------------------


def reset() -> None:
    """Empty the outbox tables (and the recorded pauses, subscriptions and
    cursors)."""
    with connection.cursor() as cursor:
        for model in (Delivery, OutboxEvent, SubscriberPause, Subscription, Cursor):
            cursor.execute(f"DELETE FROM {model._meta.db_table}")
    vacuum()


def record(**env: str) -> None:
    """Record the subscribers a relay with ``env`` has, as a deploy does
    (``outbox_subscribers --record``, or ``migrate``): stream delivery starts
    for them now, before the backlog is published."""
    subprocess.run(
        [*relay_command()[:3], "outbox_subscribers", "--record", "--settings",
         "bench.settings"],
        cwd=ROOT,
        env=child_env(**env),
        check=True,
        capture_output=True,
    )  # fmt: skip


def publish_backlog(events: int, **env: str) -> None:
    """``events`` committed OrderPlaced events, 1,000 per transaction, not fanned
    out, for the subscribers a relay with ``env`` has (recorded first)."""
    reset()
    record(**env)
    publish_orders(events, "bench.Order")
    vacuum()


def publish_one(order_id: int) -> tuple[str, float]:
    """Commit one event; (its id, ``time.time()`` right after the COMMIT)."""
    committed: list[float] = []
    with transaction.atomic():
        transaction.on_commit(lambda: committed.append(time.time()))
        (row,) = publish(
            OrderPlaced(order_id=order_id, total=decimal.Decimal("9.99")),
            aggregate=("bench.Order", order_id),
        )
    return str(row.id), committed[0]


def copy_as_pending(subscriber: str) -> None:
    """A PENDING delivery of ``subscriber`` for every event, due now."""
    now = connection.ops.adapt_datetimefield_value(timezone.now())
    with connection.cursor() as cursor:
        cursor.execute(
            "INSERT INTO outbox_app_delivery (event_id, subscriber, event_type, "
            "aggregate_type, aggregate_id, aggregate_version, tenant_id, state, "
            "attempts, next_retry_at, locked_by, last_error, last_error_type, "
            "last_traceback, created_at, updated_at) "
            "SELECT id, %s, event_type, aggregate_type, aggregate_id, "
            "aggregate_version, tenant_id, 'PENDING', 0, %s, '', '', '', '', %s, %s "
            "FROM outbox_app_outboxevent",
            [subscriber, now, now, now],
        )
    vacuum()


def goal(text: str, met: bool) -> None:
    print(f"goal: {text}: {'met' if met else 'MISSED'}")


# --- a) relay --once to RabbitMQ ----------------------------------------------------


def broker(args: argparse.Namespace) -> None:
    variants = {
        "relay --once": [],
        "relay --once --batch-size 100": ["--batch-size", "100"],
    }
    rates: dict[str, list[float]] = {
        "raw pika": [],
        "raw py-amqp": [],
        **{name: [] for name in variants},
    }
    env = {"BENCH_PUBLISHERS": publishers()}
    empty: list[float] = []
    meter = CpuMeter()
    cpu: dict[str, list[dict[str, float]]] = {"raw pika": [], "relay --once": []}
    wal: list[float] = []
    for round_ in range(args.rounds):
        empty.append(start_up(**env))
        publish_backlog(args.events, **env)
        messages = [
            rabbit.encode(context_for(event, subscriber=PUBLISHER))
            for event in OutboxEvent.objects.iterator(chunk_size=2000)
        ]
        rabbit.declare(EXCHANGE, QUEUE)
        meter.start()
        rates["raw pika"].append(rabbit.raw_pika(messages, EXCHANGE))
        cpu["raw pika"].append(meter.stop())
        rabbit.declare(EXCHANGE, QUEUE)
        rates["raw py-amqp"].append(rabbit.raw_amqp(messages, EXCHANGE))
        for i, (name, extra) in enumerate(variants.items()):
            if i:
                publish_backlog(args.events, **env)
            rabbit.declare(EXCHANGE, QUEUE)
            meter.start()
            lsn = wal_position()
            rates[name].append(args.events / relay_once(args.events, *extra, **env))
            if name in cpu:
                cpu[name].append(meter.stop())
                if lsn is not None:
                    wal.append(wal_written(lsn) / args.events)
            queued = rabbit.count(QUEUE)
            assert queued == args.events, (name, queued)
        print_round(round_, rates)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{VENDOR}, {args.events:,} events published, not fanned out; relay with "
        f"default settings, process start included ({statistics.median(empty):.2f} "
        f"s: relay --once with nothing to do); {args.rounds} round(s); confirm "
        f"window of the raw clients {rabbit.WINDOW}"
    )
    summarize(
        medians,
        medians["raw pika"],
        column="publisher (ratio: to raw pika)",
        unit="events/s",
        title=f"relay --once to RabbitMQ, {args.events:,} events ({VENDOR})",
        plot=args.plot,
    )
    print_cpu(cpu, args.events, medians, ("self", "relay", "database", "rabbitmq"))
    if wal:
        print(
            f"WAL per event, relay --once (the whole cluster's, median): "
            f"{statistics.median(wal):,.0f} bytes"
        )
    ratio = medians["relay --once"] / medians["raw pika"]
    goal(f"relay --once >= 0.8x raw pika (is {ratio:.2f}x)", ratio >= 0.8)
    reset()
    rabbit.delete(EXCHANGE, QUEUE)


def wal_position() -> str | None:
    """PostgreSQL's current WAL position (None elsewhere)."""
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_current_wal_lsn()::text")
        return cursor.fetchone()[0]


def wal_written(since: str) -> float:
    """Bytes of WAL the whole cluster wrote since the position ``since``."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s)", [since])
        return float(cursor.fetchone()[0])


def print_round(round_: int, rates: dict[str, list[float]]) -> None:
    print(
        f"round {round_ + 1}: "
        + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
        flush=True,
    )


# --- b) relay --once, a no-op handler ----------------------------------------------


def handlers(args: argparse.Namespace) -> None:
    rates: dict[str, list[float]] = {"bare loop": [], "relay --once": []}
    empty: list[float] = []
    for round_ in range(args.rounds):
        empty.append(start_up(BENCH_NOOP_HANDLER="1"))
        publish_backlog(args.events, BENCH_NOOP_HANDLER="1")
        seconds = relay_once(args.events, BENCH_NOOP_HANDLER="1")
        rates["relay --once"].append(args.events / seconds)
        copy_as_pending("bench.baseline")
        began = time.perf_counter()
        done = bare.drain(connection.settings_dict, "bench.baseline")
        rates["bare loop"].append(done / (time.perf_counter() - began))
        assert done == args.events, done
        print_round(round_, rates)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{VENDOR}, {args.events:,} events published, not fanned out; relay with "
        f"default settings, process start included ({statistics.median(empty):.2f} "
        f"s: relay --once with nothing to do); bare loop: batches of {bare.BATCH}, "
        f"no fan-out; {args.rounds} round(s)"
    )
    summarize(
        medians,
        medians["bare loop"],
        column="delivery (ratio: to the bare loop)",
        unit="deliveries/s",
        title=f"relay --once, a no-op handler, {args.events:,} events ({VENDOR})",
        plot=args.plot,
    )
    rate = medians["relay --once"]
    ratio = rate / medians["bare loop"]
    goal(f"relay --once >= 0.5x the bare loop (is {ratio:.2f}x)", ratio >= 0.5)
    goal(f"relay --once >= 5,000 deliveries/s (is {rate:,.0f}/s)", rate >= 5000)
    reset()


# --- g) scale-out: several relays on one database ----------------------------------


def relays_once(count: int, expected: int, **env: str) -> float:
    """Start ``count`` ``relay --once`` processes at once; seconds from the
    first spawn to the last exit. Checks that together they delivered
    ``expected`` deliveries."""
    began = time.perf_counter()
    children = [spawn_relay("--once", **env) for _ in range(count)]
    outputs = [child.communicate() for child in children]
    elapsed = time.perf_counter() - began
    delivered = 0
    for child, (out, err) in zip(children, outputs, strict=True):
        if child.returncode:
            raise SystemExit(f"relay failed ({child.returncode}):\n{err}")
        summary = re.search(r"^delivered (\d+).*", out, re.MULTILINE)
        delivered += int(summary[1]) if summary else 0
    assert delivered == expected, (count, delivered)
    return elapsed


def stream_drained(
    expected: int, partitions: int, holders: int, children: list[subprocess.Popen]
) -> float:
    """Once running relays (``children``) hold the ``partitions`` cursors
    between ``holders`` of them, ``expected`` events committed in one
    transaction: seconds from that commit until no cursor has one left to
    read (polled every 20 ms)."""
    from outbox_app.ops import streams

    while (
        Cursor.objects.exclude(locked_by="").count() < partitions
        or Cursor.objects.values("locked_by").distinct().count() < holders
    ):
        for child in children:
            if child.poll() is not None:
                raise SystemExit(f"relay exited ({child.returncode})")
        time.sleep(0.1)
    with transaction.atomic():
        publish_orders(expected, "bench.Order")
    began = time.perf_counter()
    while streams.awaited():
        time.sleep(0.02)
    return time.perf_counter() - began


def relays_running(count: int, expected: int, partitions: int) -> float:
    """``count`` long-running ``relay`` processes (a no-op handler), started
    and idle before the clock starts. Row delivery: the subscriber paused by
    an operator, ``expected`` events published and fanned out by the relays,
    then resumed; seconds from the first delivery's ``completed_at`` to the
    last (the relays see the resume within ``HELD_REFRESH_SECONDS``, 1 s:
    left out). Stream delivery (``partitions`` per subscriber): once the
    relays hold every cursor between them, ``expected`` events committed in
    one transaction; seconds from that commit until no cursor has one left
    to read (polled every 20 ms)."""
    from django.db.models import Max, Min

    from outbox_app.ops import subscriptions as operations
    from outbox_app.store.gateway import streaming

    reset()
    env = {"BENCH_NOOP_HANDLER": "1", "OUTBOX_PARTITIONS": str(partitions)}
    children = [spawn_relay(quiet=True, **env) for _ in range(count)]
    try:
        if streaming():
            return stream_drained(
                expected, partitions, min(count, partitions), children
            )
        rows = Subscription.objects.all()
        while not rows.exists():
            time.sleep(0.1)
        operations.pause(rows, by="bench")
        # A running relay sees a pause within HELD_REFRESH_SECONDS.
        time.sleep(HELD_REFRESH_SECONDS + 0.5)
        publish_orders(expected, "bench.Order")
        while OutboxEvent.objects.awaiting_fanout().exists():
            time.sleep(0.25)
        done = Delivery.objects.filter(state=State.SUCCEEDED)
        assert not done.exists(), "delivered while paused: the pause was not seen"
        operations.resume(rows)
        while done.count() < expected:
            time.sleep(0.1)
        span = done.aggregate(first=Min("completed_at"), last=Max("completed_at"))
        seconds = (span["last"] - span["first"]).total_seconds()
        # The rows marked at the first completed_at were delivered before it:
        # the rate is of the others, over the span (one batch alone: no span).
        after = done.filter(completed_at__gt=span["first"]).count()
        return seconds * expected / after if after else float("nan")
    finally:
        for child in children:
            child.terminate()
        for child in children:
            child.wait()


def scaleout(args: argparse.Namespace) -> None:
    counts = [1, 2, 4]
    names = {n: f"{n} relay{'s' if n > 1 else ''}" for n in counts}
    rates: dict[str, list[float]] = {names[n]: [] for n in counts}
    if args.to == "rabbitmq":
        env = {"BENCH_PUBLISHERS": publishers()}
    else:
        env = {"BENCH_NOOP_HANDLER": "1"}
    for round_ in range(args.rounds):
        for n in counts:
            if not args.running:
                publish_backlog(args.events, **env)
            if args.to == "rabbitmq":
                rabbit.declare(EXCHANGE, QUEUE)
            if args.running:
                seconds = relays_running(n, args.events, args.partitions)
            else:
                seconds = relays_once(n, args.events, **env)
            rates[names[n]].append(args.events / seconds)
            if args.to == "rabbitmq":
                assert rabbit.count(QUEUE) >= args.events
        print_round(round_, rates)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    what = "RabbitMQ" if args.to == "rabbitmq" else "a no-op handler"
    from outbox_app.store.gateway import streaming

    if args.running and streaming():
        how = (
            f"N running relay processes with default settings but "
            f"OUTBOX_PARTITIONS={args.partitions}, to a no-op handler, holding "
            "every cursor between them; the events committed in one "
            "transaction, timed from the commit until no cursor has one left"
        )
    elif args.running:
        how = (
            "N running relay processes with default settings, to a no-op "
            "handler, the events fanned out while an operator pause held the "
            "subscriber; timed from the first SUCCEEDED to the last"
        )
    else:
        how = (
            f"events published, not fanned out; N relay --once processes with "
            f"default settings started together, to {what}, timed from the "
            f"first spawn to the last exit"
        )
    print(f"{VENDOR}, {args.events:,} events; {how}; {args.rounds} round(s)")
    summarize(
        medians,
        medians[names[1]],
        column="relays (ratio: to one relay)",
        unit="deliveries/s",
        title=f"N relays on one database, {what}, {args.events:,} events ({VENDOR})",
        plot=args.plot,
    )
    two, four = medians[names[2]], medians[names[4]]
    goal(
        f"2 relays >= 1.3x one (is {two / medians[names[1]]:.2f}x)",
        two >= 1.3 * medians[names[1]],
    )
    goal(f"4 relays no slower than 2 (is {four / two:.2f}x)", four >= two)
    reset()
    if args.to == "rabbitmq":
        rabbit.delete(EXCHANGE, QUEUE)


# --- f) scheduled rows ahead -------------------------------------------------------


def scheduled(args: argparse.Namespace) -> None:
    alone, beside = "due events alone", f"beside {args.scheduled:,} scheduled"
    done = f"beside {args.scheduled:,} delivered"
    rates: dict[str, list[float]] = {alone: [], done: [], beside: []}
    tomorrow = datetime.timedelta(days=1)
    noop = {"BENCH_NOOP_HANDLER": "1"}
    for round_ in range(args.rounds):
        publish_backlog(args.events, **noop)
        rates[alone].append(args.events / relay_once(args.events, **noop))
        # The same table sizes without a schedule: what the size alone costs.
        for name, ahead, schedule in (
            (done, args.scheduled, {}),
            (beside, 0, {"deliver_at": tomorrow}),
        ):
            reset()
            record(**noop)
            publish_orders(args.scheduled, "bench.Later", **schedule)
            # Delivers them if due; else writes their PENDING rows, due
            # tomorrow (fan-out; stream delivery: its cursor passes them).
            relay_once(ahead, **noop)
            publish_orders(args.events, "bench.Order")
            vacuum()
            rates[name].append(args.events / relay_once(args.events, **noop))
        waiting = Delivery.objects.filter(state=State.PENDING).count()
        assert waiting == args.scheduled, waiting
        print_round(round_, rates)
    medians = {k: statistics.median(v) for k, v in rates.items()}
    summarize(
        medians,
        medians[alone],
        column="delivery (ratio: to the due events alone)",
        unit="deliveries/s",
        title=f"relay --once, {args.events:,} due events, a no-op handler ({VENDOR})",
        plot=args.plot,
    )
    ratio = medians[beside] / medians[done]
    goal(
        f"beside scheduled rows >= 0.9x beside as many delivered ones (is "
        f"{ratio:.2f}x; {medians[beside] / medians[alone]:.2f}x alone)",
        ratio >= 0.9,
    )
    reset()


# --- c) latency -----------------------------------------------------------------


def listen(path: str) -> None:
    """The wake-up floor: a bare psycopg process blocked in LISTEN on the
    relays' channel; appends ``time.time()`` per delivery to ``path``."""
    import psycopg

    from outbox_app.relay.wake import CHANNEL

    settings = connection.settings_dict
    conn = psycopg.connect(
        dbname=settings["NAME"],
        user=settings["USER"] or None,
        password=settings["PASSWORD"] or None,
        host=settings["HOST"] or None,
        port=settings["PORT"] or None,
        autocommit=True,
    )
    conn.execute(f"LISTEN {CHANNEL}")
    with open(path, "a", buffering=1) as out:
        for _ in conn.notifies():
            out.write(f"- {time.time()}\n")


def received(path: Path) -> list[tuple[str, float]]:
    """``(key, time)`` per line written so far."""
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [(key, float(at)) for key, at in (line.split() for line in lines)]


def warm_up(path: str, log: Path, child: subprocess.Popen) -> int:
    """Publish an event every 0.5 s until the child marks one (it is up and
    listening), then five more one at a time; returns the marks so far."""
    deadline = time.monotonic() + 60
    order_id = -1
    while not received(log):
        if time.monotonic() > deadline or child.poll() is not None:
            raise SystemExit(f"{path}: the child never marked an event")
        publish_one(order_id)
        order_id -= 1
        time.sleep(0.5)
    for _ in range(5):
        marked = len(received(log))
        publish_one(order_id)
        order_id -= 1
        while len(received(log)) <= marked:
            if time.monotonic() > deadline or child.poll() is not None:
                raise SystemExit(f"{path}: no mark for a warm-up event")
            time.sleep(0.01)
    time.sleep(0.5)
    return len(received(log))


def marks(path: str, log: Path, offset: int, committed: list) -> dict[str, float]:
    """Event id -> the time ``path``'s child marked it, for the ``committed``
    events (the first mark: delivery is at least once)."""
    lines = received(log)[offset:]
    if path == FLOOR:  # one delivery per commit, in commit order
        return {e: at for (e, _), (_, at) in zip(committed, lines, strict=False)}
    at: dict[str, float] = {}
    for event_id, t in lines:
        at.setdefault(event_id, t)
    return at


def latency_run(path: str, events: int, rate: float) -> list[float]:
    """Milliseconds from commit to ``path``'s mark, one per event, sorted."""
    reset()
    tmp = tempfile.TemporaryDirectory(prefix="bench-users-")
    log = Path(tmp.name) / "marks.log"
    if path == FLOOR:
        command = [sys.executable, "-m", "bench.bench_users", "_listen", str(log)]
        env = child_env()
    elif path == "handler":
        command, env = relay_command(), child_env(BENCH_LATENCY_FILE=str(log))
    else:
        rabbit.declare(EXCHANGE, QUEUE)
        command = relay_command()
        env = child_env(
            BENCH_PUBLISHERS=publishers(
                backend="bench.benchapp.publishers.ConfirmTimes"
            ),
            BENCH_CONFIRM_FILE=str(log),
        )
    child = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    try:
        offset = warm_up(path, log, child)
        committed = []
        began = time.perf_counter()
        for seq in range(events):
            delay = began + seq / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            committed.append(publish_one(seq))
        deadline = time.monotonic() + 60
        while len(at := marks(path, log, offset, committed)) < len(committed):
            if time.monotonic() > deadline:
                missing = len(committed) - len(at)
                raise SystemExit(f"{path}: {missing} events never marked")
            time.sleep(0.2)
    finally:
        child.terminate()
        child.wait(30)
        tmp.cleanup()
    if path == "confirm":
        rabbit.delete(EXCHANGE, QUEUE)
    return sorted((at[e] - t) * 1e3 for e, t in committed)


def latency(args: argparse.Namespace) -> None:
    paths = ["handler", "confirm"]
    if connection.vendor == "postgresql":
        paths.insert(0, FLOOR)
    results: dict[str, dict[str, float]] = {}
    for path in paths:
        ms = latency_run(path, args.events, args.rate)
        results[path] = {
            "p50": statistics.median(ms),
            "p90": percentile(ms, 0.90),
            "p99": percentile(ms, 0.99),
            "max": ms[-1],
        }
    # The broker's own share: publish one persistent message, wait for its
    # confirm (no database, no relay).
    rabbit.declare(EXCHANGE, QUEUE)
    publish_backlog(1)
    message = rabbit.encode(
        context_for(OutboxEvent.objects.get(), subscriber=PUBLISHER)
    )
    ms = rabbit.confirm_latency(message, EXCHANGE, min(args.events, 1000), args.rate)
    rabbit.delete(EXCHANGE, QUEUE)
    raw_confirm = {
        "p50": statistics.median(ms),
        "p90": percentile(ms, 0.90),
        "p99": percentile(ms, 0.99),
        "max": ms[-1],
    }
    floor = results.get(FLOOR)
    print(
        f"{VENDOR}, {args.events:,} events at {args.rate:.0f}/s, one per "
        "transaction; relay with default settings"
        + (", LISTEN/NOTIFY" if floor else ", adaptive poll")
    )
    columns = results["handler"]
    print(f"{'commit ->':<22}" + "".join(f"{k + ' ms':>10}" for k in columns))
    for path, figures in results.items():
        label = {
            FLOOR: "LISTEN wake (floor)",
            "handler": "handler start",
            "confirm": "broker confirm",
        }[path]
        line = f"{label:<22}" + "".join(f"{v:>10.1f}" for v in figures.values())
        if floor and path != FLOOR:
            line += f"   p50 = {figures['p50'] / floor['p50']:.1f}x the floor"
        print(line)
    print(
        f"{'(raw publish->confirm)':<22}"
        + "".join(f"{v:>10.1f}" for v in raw_confirm.values())
        + "   the broker alone, no relay"
    )
    handler_, confirm = results["handler"], results["confirm"]
    goal(f"handler p50 <= 5 ms (is {handler_['p50']:.1f})", handler_["p50"] <= 5)
    goal(f"handler p99 <= 25 ms (is {handler_['p99']:.1f})", handler_["p99"] <= 25)
    goal(f"confirm p50 <= 8 ms (is {confirm['p50']:.1f})", confirm["p50"] <= 8)
    if args.plot:
        from bench.plot import bars

        path = bars(
            args.plot,
            f"Commit -> handler start / broker confirm, {args.rate:.0f} events/s, "
            f"relay with defaults ({VENDOR})",
            "milliseconds (log scale)",
            list(results),
            {k: [r[k] for r in results.values()] for k in ("p50", "p90", "p99")},
            log=True,
        )
        print(f"plot: {path}")
    reset()


# --- d) publish() overhead -------------------------------------------------------


def overhead(extra: list[str]) -> None:
    command = [sys.executable, "-m", "bench.bench_overhead", *extra]
    raise SystemExit(subprocess.run(command, cwd=ROOT, env=child_env()).returncode)


# --- e) outage -------------------------------------------------------------------


def outage(args: argparse.Namespace) -> None:
    from tests.brokers.proxy import TcpProxy

    reset()
    rabbit.declare(EXCHANGE, QUEUE)
    proxy = TcpProxy((rabbit.HOST, rabbit.PORT))
    url = f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
    env = {"BENCH_PUBLISHERS": publishers(url)}
    record(**env)
    child = subprocess.Popen(
        relay_command(),
        cwd=ROOT,
        env=child_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    logged: list[tuple[float, str]] = []

    def read_log() -> None:
        for line in child.stderr:
            logged.append((time.time(), line.rstrip()))

    threading.Thread(target=read_log, daemon=True).start()
    committed: list[tuple[str, float]] = []
    stop = threading.Event()

    def writer() -> None:
        began = time.perf_counter()
        while not stop.is_set():
            delay = began + len(committed) / args.rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            committed.append(publish_one(len(committed)))
        connections.close_all()

    samples: list[tuple[float, int, int, int]] = []  # time, waiting, expired, retried

    def sampler() -> None:
        rows = Delivery.objects.filter(subscriber=PUBLISHER)
        while not stop.is_set():
            done = len(delivered().get(PUBLISHER, ()))
            expired = rows.filter(state=State.DEAD).count()
            retried = rows.filter(attempts__gt=1).count()
            samples.append((time.time(), len(committed) - done, expired, retried))
            stop.wait(1.0)
        connections.close_all()

    thread = threading.Thread(target=writer, name="writer")
    thread.start()
    watcher = threading.Thread(target=sampler, name="sampler")
    watcher.start()
    try:
        time.sleep(args.before)
        cut_at = time.time()
        proxy.cut()
        print(f"RabbitMQ cut for {args.outage:.0f} s", flush=True)
        time.sleep(args.outage)
        proxy.restore()
        restored_at = time.time()
        before = [e for e, t in committed if t <= restored_at]
        drained_at = wait_delivered(before, args.outage + 300)
        print(f"restored; drained in {drained_at - restored_at:.1f} s", flush=True)
        time.sleep(args.after)
        stop.set()
        thread.join()
        wait_delivered([e for e, _ in committed], 120)
    finally:
        stop.set()
        thread.join()
        watcher.join()
        child.terminate()
        child.wait(30)
        proxy.close()
    if args.plot:
        from bench.plot import timeline

        start = samples[0][0]
        path = timeline(
            args.plot,
            f"RabbitMQ cut for {args.outage:.0f} s, relay with defaults ({VENDOR})",
            [t - start for t, *_ in samples],
            {
                "events not delivered yet": [w for _, w, _, _ in samples],
                "DEAD": [e for _, _, e, _ in samples],
                "rows with more than one attempt": [r for *_, r in samples],
            },
            (cut_at - start, restored_at - start),
            "RabbitMQ unreachable",
        )
        print(f"plot: {path}")
    during = sum(1 for _, t in committed if cut_at <= t <= restored_at)
    rows = Delivery.objects.filter(subscriber=PUBLISHER)
    expired = rows.filter(state=State.DEAD).count()
    attempts = sum(rows.values_list("attempts", flat=True))
    failed = attempts - rows.filter(state=State.SUCCEEDED).count()
    queued = rabbit.count(QUEUE)
    print(
        f"{VENDOR}, relay with default settings, writer at {args.rate:g} events/s, "
        f"outage {args.outage:.0f} s after {args.before:.0f} s"
    )
    print(f"events published: {len(committed)}, during the outage: {during}")
    print(
        f"time to drain after the restore: {drained_at - restored_at:.1f} s "
        "(every event committed before it delivered)"
    )
    print(f"messages in the queue: {queued} ({queued - len(committed)} duplicates)")
    print(
        f"delivery rows: {rows.count()}, {attempts} attempts recorded "
        f"({engine()} delivery)"
    )
    goal(f"no DEAD row (DEAD: {expired})", expired == 0)
    goal(
        f"no attempt counted for the outage (failed attempts recorded: {failed})",
        failed == 0,
    )
    print("relay log about the pause (seconds after the cut):")
    for at, line in logged:
        if re.search(r"paused|resumed", line, re.IGNORECASE):
            print(f"  {at - cut_at:+7.1f} s  {line}")
    reset()
    rabbit.delete(EXCHANGE, QUEUE)


def wait_delivered(event_ids: list[str], timeout: float) -> float:
    """Wait until :data:`PUBLISHER` delivered every event of ``event_ids``
    (whichever engine); returns when."""
    deadline = time.monotonic() + timeout
    wanted = set(event_ids)
    while True:
        done = {str(i) for i in delivered().get(PUBLISHER, ())}
        if wanted <= done:
            return time.time()
        if time.monotonic() > deadline:
            raise SystemExit(
                f"not delivered within {timeout:.0f} s "
                f"({len(wanted - done)} of {len(wanted)} left)"
            )
        time.sleep(0.2)


def main() -> None:
    if sys.argv[1:2] == ["_listen"]:
        return listen(sys.argv[2])
    if sys.argv[1:2] == ["overhead"]:
        return overhead(sys.argv[2:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    figures = parser.add_subparsers(dest="figure", required=True)
    for name, events in (("broker", 20_000), ("handlers", 50_000)):
        sub = figures.add_parser(name)
        sub.add_argument("--events", type=int, default=events)
        sub.add_argument("--rounds", type=int, default=3)
        sub.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    sub = figures.add_parser("scaleout")
    sub.add_argument("--events", type=int, default=50_000)
    sub.add_argument("--rounds", type=int, default=3)
    sub.add_argument("--to", choices=["handler", "rabbitmq"], default="handler")
    sub.add_argument(
        "--running",
        action="store_true",
        help="relays already running and idle (a no-op handler), not relay --once",
    )
    sub.add_argument(
        "--partitions",
        type=int,
        default=4,
        help="stream delivery: OUTBOX_PARTITIONS of the running relays (default 4)",
    )
    sub.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    sub = figures.add_parser("latency")
    sub.add_argument("--events", type=int, default=3000)
    sub.add_argument("--rate", type=float, default=200)
    sub.add_argument("--plot", help="save p50/p90/p99 as bench/<PLOT>.png")
    sub = figures.add_parser("outage")
    sub.add_argument("--outage", type=float, default=300, help="seconds")
    sub.add_argument("--rate", type=float, default=5, help="events/s written")
    sub.add_argument("--before", type=float, default=10, help="seconds before")
    sub.add_argument("--after", type=float, default=10, help="seconds after drain")
    sub.add_argument("--plot", help="save the timeline as bench/<PLOT>.png")
    sub = figures.add_parser("scheduled")
    sub.add_argument("--events", type=int, default=20_000)
    sub.add_argument("--scheduled", type=int, default=200_000)
    sub.add_argument("--rounds", type=int, default=3)
    sub.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    figures.add_parser("overhead", help="run bench/bench_overhead.py with ARGS")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    {
        "broker": broker,
        "handlers": handlers,
        "latency": latency,
        "outage": outage,
        "scheduled": scheduled,
        "scaleout": scaleout,
    }[args.figure](args)


if __name__ == "__main__":
    main()
