"""Where the relay's time goes when it drains a backlog into RabbitMQ.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.profile_broker [--events 30000]

Benchmark 2's outbox_app run (``bench.bench_broker.outbox``: ``deliver()`` of a
``KombuPublisher``, batches of 500) under Python's profiler, in every thread,
each stage's wall time read from it (``bench.Stopwatch``):

* ``Batch.claim``: the claim statement and the rows read back as
  ``DeliveryContext`` values (``Gateway.claim``), mostly on the claim-ahead
  thread; ``ClaimAhead.take``: how long the relay waited for it;
* ``PublisherRunner.deliver``: one batch sent and the previous one collected
  and recorded; of which ``KombuPublisher.send`` (CloudEvents encoding and
  py-amqp's ``basic_publish``) and ``PublisherRunner.finish`` (``collect``:
  waiting for the confirms; then ``Gateway.succeed``, the SUCCEEDED UPDATE);
* py-amqp's ``drain_events``, reading the confirms, wherever it is called
  (``basic_publish`` reads frames that arrived too).

Prints calls, seconds, share of the wall time and microseconds per event;
nested stages are counted in their parent too, and the thread's stages overlap
the others, so shares need not add up. The profiler slows Python code, not the
waits: encoding and ``basic_publish`` read 2-3x what they take unprofiled
(7 and 20 us an event on a 2-vCPU machine), the database's and the broker's
stages read as they are.

The stages watched are row delivery's (fan-out, claims, claim-ahead, the
SUCCEEDED marks): the run is made with ``OUTBOX_ENGINE = "rows"``, whatever
the default engine.
"""

from __future__ import annotations

import argparse
import time

import amqp
from django.core.management import call_command
from django.test.utils import override_settings

from bench import Stopwatch, bench_broker, rabbit  # bench_broker sets Django up
from outbox_app.publishers.kombu import KombuPublisher
from outbox_app.relay.batch import Batch, ClaimAhead
from outbox_app.relay.sending import PublisherRunner
from outbox_app.store.gateway import Gateway


@override_settings(OUTBOX_ENGINE="rows")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=30_000)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    watch = Stopwatch()
    watch.watch(Batch.claim, "Batch.claim (claim + read)")
    watch.watch(Gateway.claim, "  Gateway.claim")
    watch.watch(ClaimAhead.take, "ClaimAhead.take (waiting for the claim-ahead)")
    watch.watch(PublisherRunner.deliver, "PublisherRunner.deliver, of which:")
    watch.watch(KombuPublisher.send, "  KombuPublisher.send, of which:")
    watch.watch(KombuPublisher._encode, "    encode (CloudEvents JSON)")
    watch.watch(amqp.Channel.basic_publish, "    basic_publish (py-amqp)")
    watch.watch(PublisherRunner.finish, "  PublisherRunner.finish, of which:")
    watch.watch(KombuPublisher.collect, "    KombuPublisher.collect")
    watch.watch(Gateway.succeed, "    Gateway.succeed (SUCCEEDED UPDATE)")
    watch.watch(amqp.Connection.drain_events, "drain_events (py-amqp, any caller)")
    watch.watch(Gateway.renew, "Gateway.renew")
    watch.watch(Gateway.fail, "Gateway.fail")
    watch.watch(Gateway.release, "Gateway.release")
    publisher = KombuPublisher(
        "bench-broker",
        {
            "URL": rabbit.URL,
            "EXCHANGE": bench_broker.EXCHANGE,
            "DECLARE": [bench_broker.QUEUE],
        },
    )
    bench_broker.prepare(args.events, publisher)
    bench_broker.purge()
    began = time.perf_counter()
    with watch.running():
        rate = bench_broker.outbox(args.events, publisher, 500)
    wall = time.perf_counter() - began
    print(
        f"{args.events:,} events in {wall:.2f} s: {rate:,.0f} events/s (row delivery)"
    )
    watch.report(wall, args.events)
    bench_broker.purge()
    publisher.close()


if __name__ == "__main__":
    main()
