"""Where the relay's time goes when it drains a backlog into Kafka.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_kafka \\
        .venv/bin/python -m bench.profile_kafka [--events 20000]

``bench.bench_kafka``'s ``deliver()`` run (a ``KafkaPublisher`` in this
process, batches of 500, to a tansu the script starts) under Python's
profiler, in every thread, each stage's wall time read from it
(``bench.Stopwatch``):

* ``Batch.claim``: the claim statement and the rows read back as
  ``DeliveryContext`` values, mostly on the claim-ahead thread;
  ``ClaimAhead.take``: how long the relay waited for it;
* ``PublisherRunner.deliver``: one batch sent and the previous one collected
  and recorded; of which ``KafkaPublisher.send`` (encoding: topic, key,
  CloudEvents value, headers; librdkafka's ``produce``) and
  ``PublisherRunner.finish`` (``KafkaPublisher.collect``: serving the
  delivery reports; then ``Gateway.succeed``, the SUCCEEDED UPDATE, on the
  mark thread where it runs there).

Prints calls, seconds, share of the wall time and microseconds per event;
nested stages are counted in their parent too, and the threads' stages
overlap the others, so shares need not add up. The profiler slows Python
code 2-3x, not the waits on the database or the broker.

Then, unprofiled, the publisher alone (``--alone-rounds``, 5): the same
events' delivery contexts, read beforehand, handed to ``send`` in batches
of 500, each batch's reports collected after the next batch is sent (the
relay's window), no database: the calling thread's CPU time per record
(``time.thread_time``; encoding, ``produce``, serving the reports) and the
records/s, medians over the rounds.

The stages watched are row delivery's (fan-out, claims, claim-ahead, the
SUCCEEDED marks): the run is made with ``OUTBOX_ENGINE = "rows"``, whatever
the default engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from django.core.management import call_command
from django.test.utils import override_settings

from bench import Stopwatch, context_for
from bench.bench_kafka import PUBLISHER, options  # sets Django up
from bench.bench_nats import in_process
from bench.bench_users import publish_backlog, reset
from outbox_app import OutboxEvent
from outbox_app.publishers import cloudevents
from outbox_app.publishers.kafka import KafkaPublisher
from outbox_app.relay.batch import Batch, ClaimAhead
from outbox_app.relay.sending import PublisherRunner
from outbox_app.store.gateway import Gateway
from tests.brokers.tansu import Tansu


@override_settings(OUTBOX_ENGINE="rows")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--alone-rounds", type=int, default=5)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    watch = Stopwatch()
    watch.watch(Batch.claim, "Batch.claim (claim + read)")
    watch.watch(ClaimAhead.take, "ClaimAhead.take (waiting for the claim-ahead)")
    watch.watch(PublisherRunner.deliver, "PublisherRunner.deliver, of which:")
    watch.watch(KafkaPublisher.send, "  KafkaPublisher.send, of which:")
    watch.watch(KafkaPublisher._encode, "    KafkaPublisher._encode, of which:")
    watch.watch(cloudevents.body, "      cloudevents.body")
    watch.watch(PublisherRunner.finish, "  PublisherRunner.finish, of which:")
    watch.watch(KafkaPublisher.collect, "    KafkaPublisher.collect")
    watch.watch(Gateway.succeed, "    Gateway.succeed (SUCCEEDED UPDATE)")
    watch.watch(Gateway.fail, "Gateway.fail")
    watch.watch(Gateway.release, "Gateway.release")
    with Tansu() as tansu:
        publisher = KafkaPublisher(PUBLISHER, options(tansu.servers, "profile"))
        # A first round unprofiled: the topic made, the producer connected.
        in_process(min(args.events, 1000), publisher)
        began = time.perf_counter()
        with watch.running():
            rate = in_process(args.events, publisher)
        wall = time.perf_counter() - began
        print(
            f"{args.events:,} events in {wall:.2f} s: {rate:,.0f}/s "
            "(profiled, row delivery)"
        )
        watch.report(wall, args.events)
        publish_backlog(args.events)
        contexts = [
            context_for(event, subscriber=PUBLISHER)
            for event in OutboxEvent.objects.iterator(chunk_size=2000)
        ]
        reset()
        runs = [alone(publisher, contexts) for _ in range(args.alone_rounds)]
        publisher.close()
    cpu, rate = (statistics.median(r[i] for r in runs) for i in (0, 1))
    print(
        f"publisher alone, {len(contexts):,} records, batches of 500: {cpu:.2f} us "
        f"of the calling thread's CPU per record, {rate:,.0f} records/s "
        f"(medians of {len(runs)})"
    )


def alone(publisher: KafkaPublisher, contexts: list) -> tuple[float, float]:
    """``contexts`` through ``send`` and ``collect`` as the relay pipelines
    them (batch N collected after batch N+1 is sent); (microseconds of this
    thread's CPU per record, records/s)."""
    cpu, began = time.thread_time(), time.perf_counter()
    flight = None
    for start in range(0, len(contexts), 500):
        sent = publisher.send(contexts[start : start + 500])
        if flight is not None:
            assert not any(publisher.collect(flight))
        flight = sent
    assert not any(publisher.collect(flight))
    wall = time.perf_counter() - began
    return (time.thread_time() - cpu) / len(contexts) * 1e6, len(contexts) / wall


if __name__ == "__main__":
    main()
