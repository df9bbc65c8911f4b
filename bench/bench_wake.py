"""What ``OUTBOX_CELERY_WAKE`` adds to a commit, with the Celery broker up,
refusing connections, and stalled.

Command (a migrated ``outbox_bench`` database; RabbitMQ on 127.0.0.1:5672)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_wake

Each commit is ``transaction.atomic()`` around one ``publish()`` of one event,
timed from entering the block to its return (the on-commit hooks included),
with the ``bench.benchapp`` no-op handler registered (so a wake-up sends
``run_handlers``). Modes, in turns over ``--rounds`` rounds of ``--commits``
commits each, so drift hits all alike:

- ``off``: ``OUTBOX_CELERY_WAKE = False``: the baseline.
- ``up``: the wake-up on, RabbitMQ up (a queue of the run's own, deleted).
- ``refused``: the broker's port closed (connection refused at once).
- ``stalled``: a server that accepts the connection and never answers (a
  broker stuck, or a black hole behind a firewall).
- ``before`` (once, ``--before`` commits, broker refused): the wake-up as it
  was, ``apply_async`` in the committing thread with Celery's default publish
  retries (an ``events_committed`` receiver of the benchmark's own, the
  wake-up off).

Printed: median and 99th percentile of a commit per mode, in milliseconds, and
each mode's median minus ``up``'s (goal: ``refused`` and ``stalled`` within
2 ms of ``up``). ``--connect-timeout`` sets Celery's
``broker_connection_timeout`` (seconds, Celery's default 4): how long the
wake-up thread waits on the stalled server, which the run waits out between
modes; the commits themselves do not wait on it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import threading
import time
import uuid

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
os.environ["BENCH_NOOP_HANDLER"] = "1"

import django

django.setup()

from django.db import connection, transaction  # noqa: E402
from django.test.utils import override_settings  # noqa: E402

from bench import clear  # noqa: E402
from bench.benchapp.events import OrderPlaced  # noqa: E402
from outbox_app import events_committed, publish, tasks  # noqa: E402

RABBITMQ = "amqp://guest:guest@127.0.0.1:5672//"


def stalled_server() -> int:
    """A port that accepts connections and never answers; returns it."""
    server = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            held.append(server.accept()[0])

    threading.Thread(target=accept, daemon=True).start()
    return server.getsockname()[1]


def refused_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return probe.getsockname()[1]


def commits(n: int) -> list[float]:
    """Seconds per commit of one published event."""
    times = []
    for i in range(n):
        began = time.perf_counter()
        with transaction.atomic():
            publish(OrderPlaced(order_id=i, total=1))
        times.append(time.perf_counter() - began)
    return times


def old_wake(sender, using: str, **kwargs) -> None:
    """The wake-up before the hand-off: sent in the committing thread (an
    ``events_committed`` receiver)."""
    tasks.run_handlers.apply_async(kwargs={"using": using}, expires=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", type=int, default=10)
    parser.add_argument(
        "--connect-timeout",
        type=float,
        default=4.0,
        help="Celery's broker_connection_timeout, seconds (4: its default)",
    )
    args = parser.parse_args()
    queue = f"bench-wake-{uuid.uuid4().hex[:8]}"
    brokers = {
        "up": RABBITMQ,
        "refused": f"amqp://guest:guest@127.0.0.1:{refused_port()}//",
        "stalled": f"amqp://guest:guest@127.0.0.1:{stalled_server()}//",
    }
    print(f"{connection.vendor}: {args.rounds} rounds of {args.commits} commits")
    clear()
    commits(50)  # warm up connection and caches
    samples: dict[str, list[float]] = {m: [] for m in ("off", *brokers, "before")}
    for _ in range(args.rounds):
        for mode in ("off", *brokers):
            broker = brokers.get(mode, RABBITMQ)
            with override_settings(
                OUTBOX_CELERY_WAKE=mode != "off",
                CELERY_BROKER_URL=broker,
                CELERY_TASK_DEFAULT_QUEUE=queue,
                CELERY_BROKER_CONNECTION_TIMEOUT=args.connect_timeout,
            ):
                samples[mode] += commits(args.commits)
                tasks.flush_wakeups(10)
            clear()
    # The wake-up as it was: the current app, configured for the refused port.
    app = tasks.relay_events.app
    app.conf.broker_url = brokers["refused"]
    events_committed.connect(old_wake)
    quiet = logging.getLogger("outbox_app.publishing.outbox")  # a traceback per commit
    quiet.disabled = True
    try:
        with override_settings(OUTBOX_CELERY_WAKE=False):
            samples["before"] = commits(args.before)
    finally:
        events_committed.disconnect(old_wake)
        quiet.disabled = False
    clear()
    with tasks.celery_app().connection_for_write() as conn:
        conn.default_channel.queue_delete(queue)

    up = statistics.median(samples["up"])
    print(f"{'mode':<9} {'commits':>7} {'median ms':>10} {'p99 ms':>8} {'- up ms':>8}")
    for mode, times in samples.items():
        times = sorted(times)
        median = statistics.median(times)
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(
            f"{mode:<9} {len(times):>7} {median * 1000:>10.2f} {p99 * 1000:>8.2f} "
            f"{(median - up) * 1000:>+8.2f}"
        )


if __name__ == "__main__":
    main()
