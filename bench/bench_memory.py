"""The relay's peak memory with large payloads, and its rate with small ones:
the real ``python -m django relay --once`` process of a fresh project with
DEFAULT settings (``bench/settings.py``), as ``bench/bench_users.py`` runs it.

Commands (an ``outbox_bench`` database, as for ``bench/bench_users.py``)::

    PG=postgres://postgres@127.0.0.1:5432/outbox_bench
    # 300 events of 1 MB each to a no-op handler, then to RabbitMQ
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --events 300 \\
        --payload-bytes 1000000 --to handler
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --events 300 \\
        --payload-bytes 1000000 --to rabbitmq
    # the rate with small payloads: 20,000 events of 100 bytes
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --events 20000 \\
        --payload-bytes 100 --to handler --rounds 3

``--events`` events of type ``bench.Blob`` whose payload JSON is
``--payload-bytes`` long are published (``publish()``, 10 per transaction,
not fanned out), then ``relay --once`` runs in its own process with the
no-op handler ``bench.blob`` (``BENCH_BLOB_HANDLER=1``) or a default
``KombuPublisher`` to the queue ``outbox-bench-users``, and is timed from
spawn to exit. Its peak RSS is the ``VmHWM`` of ``/proc/<pid>/status``, read
every 10 ms while it runs (a high-water mark: the last reading is the peak
unless the peak came in the last 10 ms). Prints, per round: events/s and peak
MiB; then the medians.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from django.db import transaction

from bench import rabbit, vacuum
from bench.bench_users import (  # sets up Django with bench.settings
    EXCHANGE,
    QUEUE,
    ROOT,
    child_env,
    publishers,
    relay_command,
    reset,
)
from outbox_app import Notification, publish
from outbox_app.states import State

EVENT_TYPE = "bench.Blob"


def publish_blobs(events: int, payload_bytes: int) -> None:
    reset()
    blob = "x" * max(0, payload_bytes - len('{"blob": ""}'))
    for start in range(0, events, 10):
        with transaction.atomic():
            publish(
                *[
                    {"event_type": EVENT_TYPE, "payload": {"blob": blob}}
                    for _ in range(start, min(events, start + 10))
                ]
            )
    vacuum()


def peak_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            text = status.read()
    except FileNotFoundError:
        return None
    if "VmHWM:" not in text:  # exited, not reaped yet
        return None
    return int(text.split("VmHWM:")[1].split()[0])


def run_relay(expected: int, **env: str) -> tuple[float, float]:
    """``relay --once`` to its exit: (seconds, peak RSS in MiB)."""
    began = time.perf_counter()
    child = subprocess.Popen(
        relay_command("--once"),
        cwd=ROOT,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    peak = 0
    while child.poll() is None:
        peak = max(peak, peak_kib(child.pid) or 0)
        time.sleep(0.01)
    elapsed = time.perf_counter() - began
    out, err = child.communicate()
    if child.returncode:
        raise SystemExit(f"relay failed ({child.returncode}):\n{err[-3000:]}")
    done = Notification.objects.filter(state=State.SUCCEEDED).count()
    assert done == expected, f"{done} of {expected} delivered:\n{out[-500:]}"
    return elapsed, peak / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--payload-bytes", type=int, default=1_000_000)
    parser.add_argument("--to", choices=("handler", "rabbitmq"), default="handler")
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    if args.to == "handler":
        env = {"BENCH_BLOB_HANDLER": "1"}
    else:
        env = {"BENCH_PUBLISHERS": publishers()}
    rates, peaks = [], []
    for round_ in range(1, args.rounds + 1):
        if args.to == "rabbitmq":
            rabbit.declare(EXCHANGE, QUEUE)
        publish_blobs(args.events, args.payload_bytes)
        seconds, peak = run_relay(args.events, **env)
        if args.to == "rabbitmq":
            assert rabbit.count(QUEUE) == args.events, rabbit.count(QUEUE)
        rates.append(args.events / seconds)
        peaks.append(peak)
        print(
            f"round {round_}: {args.events:,} events of {args.payload_bytes:,} "
            f"bytes to {args.to}: {seconds:.1f} s, {rates[-1]:,.0f} events/s, "
            f"peak RSS {peak:,.1f} MiB"
        )
    print(
        f"median: {statistics.median(rates):,.0f} events/s, peak RSS "
        f"{statistics.median(peaks):,.1f} MiB (max {max(peaks):,.1f})"
    )
    if args.to == "rabbitmq":
        rabbit.declare(EXCHANGE, QUEUE)  # empty the queue again


if __name__ == "__main__":
    main()
