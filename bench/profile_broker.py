"""Where the relay's time goes when it drains a backlog into RabbitMQ.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.profile_broker [--events 30000]

Benchmark 2's outbox_app run (``bench.bench_broker.outbox``: ``deliver()`` of a
``KombuPublisher``, batches of 500) with each stage wrapped in a wall-clock
timer instead of a profiler, which would slow the Python stages more than the
waits: the claim and read (on the claim-ahead thread, and how long the relay
waited for them), building the ``DeliveryContext``, encoding, py-amqp's
``basic_publish``, waiting for the confirms (``drain_events``) and the
SUCCEEDED UPDATE. Prints seconds, share of the wall time and microseconds per
event; the thread's stages overlap the others, so shares need not add up.
"""

from __future__ import annotations

import argparse
import collections
import functools
import threading
import time

import amqp
from django.core.management import call_command

from bench import bench_broker  # sets Django up
from outbox_app import querysets, relay
from outbox_app.publishers.kombu import KombuPublisher

spent: collections.defaultdict[str, float] = collections.defaultdict(float)


def timed(owner: object, name: str, label: str) -> None:
    """Replace ``owner.name`` by a wrapper that adds its wall time to ``label``."""
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            thread = threading.current_thread() is not threading.main_thread()
            spent[label + (" (claim-ahead thread)" if thread else "")] += (
                time.perf_counter() - began
            )

    setattr(owner, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=30_000)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    timed(relay._Batch, "claim", "claim + read")
    timed(relay._ClaimAhead, "take", "waiting for the claim-ahead")
    timed(relay, "context_for", "DeliveryContext")
    timed(KombuPublisher, "send_batch", "send_batch, of which:")
    timed(KombuPublisher, "_encode", "  encode (CloudEvents JSON)")
    timed(amqp.Channel, "basic_publish", "  basic_publish (py-amqp)")
    timed(amqp.Connection, "drain_events", "  waiting for confirms")
    timed(querysets.NotificationQuerySet, "succeed", "SUCCEEDED UPDATE")
    publisher = KombuPublisher(
        "bench-broker",
        {
            "URL": bench_broker.URL,
            "EXCHANGE": bench_broker.EXCHANGE,
            "DECLARE": [bench_broker.QUEUE],
        },
    )
    bench_broker.prepare(args.events, publisher)
    bench_broker.purge()
    began = time.perf_counter()
    rate = bench_broker.outbox(args.events, publisher, 500)
    wall = time.perf_counter() - began
    print(f"{args.events:,} events in {wall:.2f} s: {rate:,.0f} events/s")
    for label, seconds in spent.items():
        print(
            f"{label:45} {seconds:6.2f} s {seconds / wall:6.1%} "
            f"{seconds / args.events * 1e6:6.0f} us/event"
        )
    bench_broker.purge()


if __name__ == "__main__":
    main()
