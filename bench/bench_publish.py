"""Broker publish throughput: per-message confirms vs. KombuPublisher's pipelined
confirms, measured in the same run against the same RabbitMQ.

    .venv/bin/python bench/bench_publish.py [--messages 5000] [--batch 500]
        [--url amqp://guest:guest@127.0.0.1:5672//]

Every mode publishes the same persistent CloudEvents bodies (~500 bytes) to a
durable topic exchange bound to one durable queue, which is purged between modes
and deleted at the end:

(i)   baseline: kombu ``Producer.publish`` on a connection with
      ``confirm_publish=True`` (kombu waits for each message's confirm);
(ii)  ``KombuPublisher.send_batch`` in batches of ``--batch`` (publish the whole
      batch, written with one system call, then collect its confirms);
(0)   for reference, kombu's Producer without confirms (nothing is known to have
      arrived; the outbox never does this).

Prints msg/s of each and the ratio (ii)/(i).
"""

from __future__ import annotations

import argparse
import datetime
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kombu import Connection, Exchange, Producer, Queue

from outbox_app.publishers.cloudevents import CONTENT_TYPE
from outbox_app.publishers.kombu import KombuPublisher
from outbox_app.subscribers import DeliveryContext


def contexts(count: int) -> list[DeliveryContext]:
    now = datetime.datetime.now(datetime.UTC)
    return [
        DeliveryContext(
            event_id=uuid.uuid4(),
            namespace="bench",
            event_type="OrderPlaced",
            revision=1,
            payload={"order_id": n, "total": "19.90", "lines": [{"sku": "A-1"}] * 3},
            aggregate_type="shop.Order",
            aggregate_id=str(n % 100),
            aggregate_version=n,
            headers={"correlation_id": f"req-{n}"},
            tenant_id="acme",
            action_id=None,
            occurred_at=now,
            attempt=1,
            subscriber="bench",
            notification_id=n,
        )
        for n in range(count)
    ]


def producer_rate(url, exchange, sent, bodies, keys, confirm: bool) -> float:
    options = {"confirm_publish": True} if confirm else {}
    with Connection(url, transport_options=options) as connection:
        producer = Producer(connection.channel(), exchange, auto_declare=False)
        start = time.perf_counter()
        for context, body, key in zip(sent, bodies, keys, strict=True):
            producer.publish(
                body,
                routing_key=key,
                content_type=CONTENT_TYPE,
                content_encoding="utf-8",
                delivery_mode=2,
                mandatory=True,
                message_id=str(context.event_id),
            )
        elapsed = time.perf_counter() - start
    return len(sent) / elapsed


def publisher_rate(url, exchange, sent, batch: int) -> float:
    publisher = KombuPublisher("bench", {"URL": url, "EXCHANGE": exchange.name})
    publisher.send_batch(sent[:1])  # connect and declare outside the timing
    start = time.perf_counter()
    for i in range(0, len(sent), batch):
        outcomes = publisher.send_batch(sent[i : i + batch])
        failed = [o for o in outcomes if o is not None]
        if failed:
            raise SystemExit(f"{len(failed)} messages failed: {failed[0]}")
    elapsed = time.perf_counter() - start
    publisher.close()
    return len(sent) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672//")
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=500)
    args = parser.parse_args()

    name = f"outbox-bench-{uuid.uuid4().hex[:8]}"
    exchange = Exchange(name, "topic", durable=True)
    queue = Queue(name, exchange, routing_key="#", durable=True)
    sent = contexts(args.messages)
    encoder = KombuPublisher("encode", {"URL": args.url})
    encoded = [encoder._encode(c) for c in sent]
    bodies = [e[0] for e in encoded]
    keys = [e[1] for e in encoded]

    with Connection(args.url) as admin:
        bound = queue(admin.channel())
        bound.declare()
        try:
            rates = {}
            for label, run in (
                ("(0) kombu Producer, no confirms", lambda: producer_rate(
                    args.url, exchange, sent, bodies, keys, confirm=False)),
                ("(i) kombu Producer, confirm_publish (per message)", lambda:
                    producer_rate(args.url, exchange, sent, bodies, keys, True)),
                (f"(ii) KombuPublisher.send_batch, batches of {args.batch}",
                    lambda: publisher_rate(args.url, exchange, sent, args.batch)),
            ):  # fmt: skip
                rates[label] = run()
                bound.purge()
                print(f"{label:<55} {rates[label]:>8,.0f} msg/s", flush=True)
        finally:
            bound.delete()
            exchange(admin.channel()).delete()
    baseline, pipelined = list(rates.values())[1:]
    body_bytes = sum(map(len, bodies)) // len(bodies)
    print(
        f"ratio (ii)/(i): {pipelined / baseline:.1f}x  "
        f"({args.messages} persistent messages of ~{body_bytes} bytes)"
    )


if __name__ == "__main__":
    main()
