"""The catalog's search indexer: a CoreWrite subscriber, in Python.

It reads the shop's catalog events (``FORMAT: corewrite`` on a fanout
exchange: the shop's ``catalog`` publisher) as a subscriber written for a
CoreWrite outbox does, the Node search indexer of CoreWrite's documentation
line by line: parse the message, switch on ``EVENT_TYPE``, index
``PAYLOAD`` under ``AGGREGATE_ID``, log ``USER``; ack after the index is
written. No Django and no outbox_app here: only the wire format is shared.

    OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672// \\
        python -m sample_consumer.search_indexer

Environment:
    OUTBOX_BROKER_URL: the shop's broker.
    SHOP_CATALOG_EXCHANGE: the shop's catalog exchange (default
        ``shop.catalog``, fanout).
    SEARCH_QUEUE: this subscriber's durable queue (default ``search-indexer``).
    SEARCH_INDEX: the index, a JSON file standing in for Elasticsearch
        (default ``search-index.json``): ``{"documents": {id: document},
        "seen": [event ids]}``.

Messages arrive at least once: the index keeps the ``OUTBOX_ID`` of every
event it applied and skips one it has seen. It stops on SIGTERM or SIGINT.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from kombu import Connection, Exchange, Queue

logger = logging.getLogger("search_indexer")


def handle_event(event: dict[str, Any], documents: dict[str, dict]) -> str:
    """Apply one CoreWrite event to the index; what was done, for the log."""
    match event["EVENT_TYPE"]:
        case "ListingCreated":
            documents[event["AGGREGATE_ID"]] = event["PAYLOAD"]
            return f"Indexed listing: {event['AGGREGATE_ID']}"
        case "ListingUpdated":
            documents.setdefault(event["AGGREGATE_ID"], {}).update(event["PAYLOAD"])
            return f"Updated listing index: {event['AGGREGATE_ID']}"
        case "ListingDeleted" | "ListingForceDeleted":
            documents.pop(event["AGGREGATE_ID"], None)
            return f"Removed listing from index: {event['AGGREGATE_ID']}"
    return f"Ignored {event['EVENT_TYPE']}"


class Index:
    """The documents and the ids of the events applied, kept in one JSON file
    written whole (rename) after each event."""

    def __init__(self, path: Path):
        self.path = path
        data = json.loads(path.read_text()) if path.exists() else {}
        self.documents: dict[str, dict] = data.get("documents", {})
        self.seen: set[str] = set(data.get("seen", []))

    def apply(self, event: dict[str, Any]) -> str:
        if event["OUTBOX_ID"] in self.seen:
            return f"Skipped a redelivery: {event['OUTBOX_ID']}"
        done = handle_event(event, self.documents)
        self.seen.add(event["OUTBOX_ID"])
        partial = self.path.with_suffix(".tmp")
        partial.write_text(
            json.dumps({"documents": self.documents, "seen": sorted(self.seen)})
        )
        partial.replace(self.path)
        return done


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # to stderr
    url = os.environ["OUTBOX_BROKER_URL"]
    exchange = Exchange(
        os.environ.get("SHOP_CATALOG_EXCHANGE", "shop.catalog"), "fanout", durable=True
    )
    queue = Queue(
        os.environ.get("SEARCH_QUEUE", "search-indexer"), exchange, durable=True
    )
    index = Index(Path(os.environ.get("SEARCH_INDEX", "search-index.json")))
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def on_message(body, message) -> None:
        event = json.loads(message.body)
        done = index.apply(event)
        logger.info("%s (by %s)", done, event["USER"] or "nobody")
        message.ack()

    with (
        Connection(url) as connection,
        connection.Consumer(queue, callbacks=[on_message], accept=["json"]),
    ):
        logger.info("Search indexer started. Waiting for events...")
        while not stopping:  # idle half a second: look at the flag again
            with contextlib.suppress(TimeoutError):
                connection.drain_events(timeout=0.5)
    sys.exit(0)


if __name__ == "__main__":
    main()
