"""The relay draining pending events into NATS JetStream, against a raw nats-py
publish of the same messages with the same ack window, in the same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_nats \\
        .venv/bin/python -m bench.bench_nats [--events 20000] [--rounds 3]

Per round, on a stream created anew for each run (so nothing is dropped as a
duplicate of an earlier run), file storage, one subject per event type:

* **raw nats-py**: the events' messages (subject, CloudEvents body, headers as
  ``JetStreamPublisher`` encodes them), encoded beforehand, no database,
  published with ``JetStreamContext.publish_async`` with at most 1,000 PubAcks
  outstanding (the relay's window: two batches of 500), until every PubAck
  arrived;
* **deliver()**: ``deliver()`` of a ``JetStreamPublisher`` in this process over
  the same number of events published after it was recorded, with the
  default delivery engine (stream on PostgreSQL and SQLite: its cursor reads
  them, no delivery row; row delivery: fanned out beforehand, claimed, marked
  SUCCEEDED): read, encode, publish, collect the PubAcks, until none is due;
* **relay --once**: the real ``python -m django relay --once`` of a fresh
  project with default settings (``bench/settings.py``; the publisher from
  ``$BENCH_PUBLISHERS``, ``DECLARE`` on), over events published after its
  subscribers were recorded (``outbox_subscribers --record``, as a deploy's
  ``migrate`` does) and not fanned out, timed from spawn to exit: process
  start, Django set-up, fan-out (row delivery) included (``relay --once``
  over empty tables is printed beside).

Every message counts once JetStream acked it; the stream holds exactly
``--events`` messages after each run. Prints events/s (median over rounds) and
the ratio to the raw client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time

# The relay processes and this one define the same event class.
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

import nats  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench import (  # noqa: E402
    context_for,
    engine,
    publish_orders,
    record,
    summarize,
    vacuum,
)
from bench.bench_users import (  # noqa: E402
    VENDOR,
    publish_backlog,
    relay_once,
    reset,
    start_up,
)
from outbox_app import OutboxEvent  # noqa: E402
from outbox_app.publishers.base import Publisher  # noqa: E402
from outbox_app.publishers.nats import JetStreamPublisher  # noqa: E402
from outbox_app.relay import deliver, fan_out  # noqa: E402

URL = "nats://127.0.0.1:4222"
STREAM = "OUTBOX_BENCH"
PUBLISHER = "nats"
OPTIONS = {
    "URL": URL,
    "STREAM": STREAM,
    "SUBJECT": "outbox-bench.{event_type}",
    "DECLARE": True,
}
#: PubAcks outstanding in the raw baseline: the relay's two batches of 500.
WINDOW = 1000


async def _jetstream(work):
    client = await nats.connect(URL)
    try:
        return await work(client.jetstream(publish_async_max_pending=WINDOW))
    finally:
        await client.close()


def fresh_stream() -> None:
    """Delete the stream (and so its duplicate window), create it empty."""

    async def work(js):
        with contextlib.suppress(nats.js.errors.NotFoundError):
            await js.delete_stream(STREAM)
        await js.add_stream(
            name=STREAM, subjects=["outbox-bench.>"], duplicate_window=120
        )

    asyncio.run(_jetstream(work))


def stored() -> int:
    async def work(js):
        return (await js.stream_info(STREAM)).state.messages

    return asyncio.run(_jetstream(work))


def raw(messages: list[tuple[str, bytes, dict]]) -> float:
    """nats-py ``publish_async``, :data:`WINDOW` PubAcks outstanding; msg/s."""

    async def work(js):
        started = time.perf_counter()
        futures = [
            await js.publish_async(subject, body, headers=dict(headers))
            for subject, body, headers in messages
        ]
        await asyncio.gather(*futures)
        return len(messages) / (time.perf_counter() - started)

    return asyncio.run(_jetstream(work))


def in_process(events: int, publisher: Publisher) -> float:
    """``deliver()`` of ``publisher`` (any) over ``events`` events published
    after it was recorded (and fanned out, with row delivery): events/s."""
    reset()
    record(publisher)
    publish_orders(events, "bench.Order")
    vacuum()
    fan_out(subscribers=[publisher], batch_size=1000)
    started = time.perf_counter()
    report = deliver([publisher], batch_size=500)
    rate = events / (time.perf_counter() - started)
    assert report.succeeded == events, report
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    publisher = JetStreamPublisher(PUBLISHER, OPTIONS)
    env = {"BENCH_PUBLISHERS": json.dumps({PUBLISHER: {"BACKEND": (
        "outbox_app.publishers.nats.JetStreamPublisher"), **OPTIONS}})}  # fmt: skip
    rates: dict[str, list[float]] = {
        "raw nats-py": [],
        "deliver()": [],
        "relay --once": [],
    }
    empty: list[float] = []
    for round_ in range(args.rounds):
        fresh_stream()
        empty.append(start_up(**env))
        publish_backlog(args.events, **env)
        messages = [
            publisher._encode(context_for(event, subscriber=PUBLISHER))
            for event in OutboxEvent.objects.iterator(chunk_size=2000)
        ]
        fresh_stream()
        rates["raw nats-py"].append(raw(messages))
        assert stored() == args.events
        fresh_stream()
        rates["deliver()"].append(in_process(args.events, publisher))
        assert stored() == args.events
        fresh_stream()
        publish_backlog(args.events, **env)
        rates["relay --once"].append(args.events / relay_once(args.events, **env))
        assert stored() == args.events
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
            flush=True,
        )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{VENDOR}, {args.events:,} events, {args.rounds} round(s), batches of 500, "
        f"raw ack window {WINDOW}; relay --once with default settings, process "
        f"start included ({statistics.median(empty):.2f} s with nothing to do); "
        f"{engine()} delivery"
    )
    summarize(
        medians,
        medians["raw nats-py"],
        column="publisher (ratio: to raw nats-py)",
        unit="events/s",
        title=f"{args.events:,} events to NATS JetStream ({connection.vendor})",
        plot=args.plot,
    )
    publisher.close()
    reset()

    async def drop(js):
        await js.delete_stream(STREAM)

    asyncio.run(_jetstream(drop))


if __name__ == "__main__":
    main()
