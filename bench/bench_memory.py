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
    # the claim alone: 200 claims of 500 rows over 20,000 PENDING rows of
    # 100 bytes (unordered, then ordered), each released at once
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --events 20000 \\
        --payload-bytes 100 --backlog
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --claims 200
    DATABASE_URL=$PG .venv/bin/python -m bench.bench_memory --claims 200 --ordered

``--events`` events of type ``bench.Blob`` whose payload JSON is
``--payload-bytes`` long are published (``publish()``, 10 per transaction,
not fanned out) after the relay's subscribers were recorded
(``outbox_subscribers --record``, as a deploy's ``migrate`` does: stream
delivery, the default, delivers a subscriber the events published after its
cursor started), then ``relay --once`` runs in its own process with the
no-op handler ``bench.blob`` (``BENCH_BLOB_HANDLER=1``) or a default
``KombuPublisher`` to the queue ``outbox-bench-users``, and is timed from
spawn to exit. Its peak RSS is the ``VmHWM`` of ``/proc/<pid>/status``, read
every 10 ms while it runs (a high-water mark: the last reading is the peak
unless the peak came in the last 10 ms). Prints, per round: events/s and peak
MiB; then the medians.

``--backlog`` and ``--claims`` time row delivery's claim: they run with
``OUTBOX_ENGINE = "rows"`` whatever the default engine (the backlog is
fanned out into delivery rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

from django.db import transaction
from django.test.utils import override_settings

from bench import delivered, engine, rabbit, vacuum
from bench.bench_users import (  # sets up Django with bench.settings
    EXCHANGE,
    QUEUE,
    publishers,
    record,
    reset,
    spawn_relay,
)
from outbox_app import publish

EVENT_TYPE = "bench.Blob"


def publish_blobs(events: int, payload_bytes: int, **env: str) -> None:
    """``events`` blobs, published after the subscribers of a relay with
    ``env`` were recorded."""
    reset()
    record(**env)
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
    child = spawn_relay("--once", **env)
    peak = 0
    while child.poll() is None:
        peak = max(peak, peak_kib(child.pid) or 0)
        time.sleep(0.01)
    elapsed = time.perf_counter() - began
    out, err = child.communicate()
    if child.returncode:
        raise SystemExit(f"relay failed ({child.returncode}):\n{err[-3000:]}")
    done = delivered()
    assert done == expected, f"{done} of {expected} delivered:\n{out[-500:]}"
    return elapsed, peak / 1024


@override_settings(OUTBOX_ENGINE="rows")
def claims(count: int, ordered: bool) -> list[float]:
    """Seconds of each of ``count`` claims of ``OUTBOX_BATCH_SIZE`` rows (one
    subscriber, ordered or not) over the PENDING rows :func:`backlog` made,
    each batch released at once: the claim alone, as the relay sends it."""
    import inspect

    from django.utils import timezone

    from outbox_app.conf import outbox_settings
    from outbox_app.store.gateway import Gateway

    gateway = Gateway()
    budget = {}
    if "max_bytes" in inspect.signature(gateway.claim).parameters:
        budget["max_bytes"] = outbox_settings.BATCH_BYTES  # this tree bounds bytes
    name = "bench.ordered" if ordered else "bench.blob"
    times = []
    for _ in range(count):
        began = time.perf_counter()
        token, contexts = gateway.claim(
            [name],
            limit=outbox_settings.BATCH_SIZE,
            lease_seconds=60,
            worker="bench",
            now=timezone.now(),
            ordered=ordered,
            event_types=frozenset({EVENT_TYPE}),
            **budget,
        )
        times.append(time.perf_counter() - began)
        assert len(contexts) == outbox_settings.BATCH_SIZE, len(contexts)
        gateway.release(token, [c.delivery_id for c in contexts], timezone.now())
    return times


@override_settings(OUTBOX_ENGINE="rows")
def backlog(events: int, payload_bytes: int) -> None:
    """``events`` events fanned out to ``bench.blob`` (unordered) and
    ``bench.ordered`` (ordered, one event per aggregate), all PENDING."""
    from outbox_app.relay import fan_out
    from outbox_app.subscribers import Handler

    reset()
    blob = "x" * max(0, payload_bytes - len('{"blob": ""}'))
    for start in range(0, events, 1000):
        with transaction.atomic():
            for n in range(start, min(events, start + 1000)):
                publish(
                    {"event_type": EVENT_TYPE, "payload": {"blob": blob}},
                    aggregate=("bench.Blob", n),
                )
    types = frozenset({EVENT_TYPE})
    fan_out(
        subscribers=[
            Handler(name="bench.blob", event_types=types),
            Handler(name="bench.ordered", event_types=types, ordered=True),
        ]
    )
    vacuum()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--payload-bytes", type=int, default=1_000_000)
    parser.add_argument("--to", choices=("handler", "rabbitmq"), default="handler")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--claims",
        type=int,
        help="time this many claims over a backlog of --events rows (made by "
        "--backlog) instead of running the relay",
    )
    parser.add_argument("--ordered", action="store_true", help="with --claims")
    parser.add_argument(
        "--backlog", action="store_true", help="make the --claims backlog, then exit"
    )
    args = parser.parse_args()
    if args.backlog:
        backlog(args.events, args.payload_bytes)
        return
    if args.claims:
        times = claims(args.claims, args.ordered)
        print(
            f"{args.claims} {'ordered ' if args.ordered else ''}claims: median "
            f"{statistics.median(times) * 1000:.2f} ms, mean "
            f"{statistics.mean(times) * 1000:.2f} ms"
        )
        return
    if args.to == "handler":
        env = {"BENCH_BLOB_HANDLER": "1"}
    else:
        env = {"BENCH_PUBLISHERS": publishers()}
    rates, peaks = [], []
    for round_ in range(1, args.rounds + 1):
        if args.to == "rabbitmq":
            rabbit.declare(EXCHANGE, QUEUE)
        publish_blobs(args.events, args.payload_bytes, **env)
        seconds, peak = run_relay(args.events, **env)
        if args.to == "rabbitmq":
            assert rabbit.count(QUEUE) == args.events, rabbit.count(QUEUE)
        rates.append(args.events / seconds)
        peaks.append(peak)
        print(
            f"round {round_}: {args.events:,} events of {args.payload_bytes:,} "
            f"bytes to {args.to}: {seconds:.1f} s, {rates[-1]:,.0f} events/s, "
            f"peak RSS {peak:,.1f} MiB ({engine()} delivery)"
        )
    print(
        f"median: {statistics.median(rates):,.0f} events/s, peak RSS "
        f"{statistics.median(peaks):,.1f} MiB (max {max(peaks):,.1f})"
    )
    if args.to == "rabbitmq":
        rabbit.declare(EXCHANGE, QUEUE)  # empty the queue again


if __name__ == "__main__":
    main()
