"""Latency: commit -> handler start and commit -> broker confirm, p50/p99, at a
steady publish rate.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench1 \\
        .venv/bin/python -m bench.bench_latency [--events 5000] [--rate 200] \\
        [--paths handler,broker] [--modes notify,poll]

The publisher (this process) commits one ``publish()`` per transaction at
``--rate`` events/s and records ``time.time()`` right after the atomic block
exits. The relay runs in a separate process (``RelayWorker(kind="handler")``,
this module with ``--relay``), where a benchmark handler, registered only there,
appends ``event_id start_time`` to a file (path ``handler``), or a
``KombuPublisher`` to RabbitMQ (``--broker``, persistent messages, publisher
confirms; ``bench.benchapp.publishers.ConfirmTimes``) records when its batch's
confirms are collected (path ``broker``). Modes: ``notify`` (PostgreSQL
LISTEN/NOTIFY wake-up from publish()'s on-commit hook) and ``poll`` (the wake-up
receiver disconnected in the publisher: the relay finds events by its adaptive
poll, 50 ms doubling to ``OUTBOX_POLL_INTERVAL_SECONDS``). Publishing starts
``--settle`` seconds (2) after the relay process reports ready, so it is idle
and listening.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from bench import clear, percentile  # noqa: E402
from outbox_app import handler, publish  # noqa: E402
from outbox_app.publishing.outbox import events_committed  # noqa: E402
from outbox_app.relay.wake import wake_relays  # noqa: E402

EVENT_TYPE = "bench1.Ping"
QUEUE = "outbox-bench-latency"


def relay(log: str, path: str) -> None:
    """The relay process: one handler that records when it starts, or the
    confirm-timing publisher (path ``broker``)."""
    from outbox_app.relay.worker import RelayWorker

    if path == "handler":
        out = open(log, "a", buffering=1)  # noqa: SIM115 - open until exit

        @handler(EVENT_TYPE, name="bench1-latency")
        def record(event, context) -> None:
            started = time.time()
            out.write(f"{context.event_id} {started}\n")

    print("ready", flush=True)
    RelayWorker(kind="handler" if path == "handler" else "publisher").run()


def publish_steady(count: int, rate: float) -> dict[str, float]:
    committed = {}
    began = time.perf_counter()
    for seq in range(count):
        delay = began + seq / rate - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        with transaction.atomic():
            (row,) = publish({"event_type": EVENT_TYPE, "payload": {"seq": seq}})
        committed[str(row.id)] = time.time()
    return committed


def run_mode(
    path: str, mode: str, count: int, rate: float, broker: str, settle: float
) -> list[float]:
    """Milliseconds commit -> handler start (or broker confirm), one per event;
    publishing starts ``settle`` seconds after the relay process is up."""
    clear()
    log = Path(f"/tmp/bench1-latency-{path}-{mode}.log")
    log.unlink(missing_ok=True)
    events_committed.disconnect(wake_relays, dispatch_uid="outbox_app.wake_relays")
    if mode == "notify":
        events_committed.connect(wake_relays, dispatch_uid="outbox_app.wake_relays")
    publishers = {
        "bench-latency": {
            "BACKEND": "bench.benchapp.publishers.ConfirmTimes",
            "URL": broker,
            "EXCHANGE": QUEUE,
            "ROUTING_KEY": "{event_type}",
            "DECLARE": [QUEUE],
        }
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "bench.bench_latency", "--relay", str(log), path],
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            "OUTBOX_TEST_CONN_MAX_AGE": "0",
            "BENCH_CONFIRM_FILE": str(log),
            "OUTBOX_TEST_PUBLISHERS": json.dumps(
                publishers if path == "broker" else {}
            ),
        },
    )
    assert child.stdout.readline().strip() == "ready"
    time.sleep(settle)  # the relay is idle and listening
    committed = publish_steady(count, rate)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if log.exists() and len(log.read_text().splitlines()) >= count:
            break
        time.sleep(0.2)
    child.terminate()
    child.wait(30)
    started = {}
    for line in log.read_text().splitlines():
        event_id, at = line.split()
        started.setdefault(event_id, float(at))  # first delivery (at-least-once)
    assert len(started) == count, (len(started), count)
    if path == "broker":
        from kombu import Connection

        with Connection(broker) as amqp:
            amqp.default_channel.queue_delete(QUEUE)
    return sorted((started[e] - at) * 1e3 for e, at in committed.items())


def main() -> None:
    if sys.argv[1:2] == ["--relay"]:
        return relay(sys.argv[2], sys.argv[3])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--modes", default="notify,poll")
    parser.add_argument("--paths", default="handler,broker")
    parser.add_argument("--broker", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--plot", default=None)
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds between the relay's start and the first event",
    )
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    results = {}
    runs = [
        (path, mode)
        for path in args.paths.split(",")
        for mode in args.modes.split(",")
        if mode != "notify" or connection.vendor == "postgresql"
    ]
    for path, mode in runs:
        ms = run_mode(path, mode, args.events, args.rate, args.broker, args.settle)
        label = f"{path}, {mode}"
        results[label] = {
            "p50": statistics.median(ms),
            "p90": percentile(ms, 0.90),
            "p99": percentile(ms, 0.99),
            "max": ms[-1],
        }
        target = "handler start" if path == "handler" else "broker confirm"
        print(
            f"{connection.vendor} {mode}: commit -> {target} over {len(ms)} "
            f"events at {args.rate:.0f}/s: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in results[label].items()),
            flush=True,
        )
    from bench.plot import bars

    bars(
        args.plot or f"bench_latency_{connection.vendor}",
        f"Commit -> handler start / broker confirm on {connection.vendor}, "
        f"{args.rate:.0f} events/s",
        "milliseconds (log scale)",
        list(results),
        {k: [results[m][k] for m in results] for k in ("p50", "p90", "p99")},
        log=True,
    )


if __name__ == "__main__":
    main()
