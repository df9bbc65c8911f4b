"""Found by outbox_app's autodiscovery of each installed app's ``handlers``.

``BENCH_NOOP_HANDLER=1``: a handler that does nothing (``bench.noop``).
``BENCH_LATENCY_FILE=path``: a handler (``bench.latency``) that appends
``<event id> <time.time() at its start>`` to that file, one line per delivery.
Neither is registered otherwise.
"""

import os
import time

from outbox_app import handler

from .events import OrderPlaced

if os.environ.get("BENCH_NOOP_HANDLER") == "1":

    @handler(OrderPlaced, name="bench.noop")
    def noop(event: OrderPlaced, context) -> None:
        pass


if os.environ.get("BENCH_LATENCY_FILE"):
    _out = open(os.environ["BENCH_LATENCY_FILE"], "a", buffering=1)  # noqa: SIM115

    @handler(OrderPlaced, name="bench.latency")
    def record_start(event: OrderPlaced, context) -> None:
        started = time.time()
        _out.write(f"{context.event_id} {started}\n")


if os.environ.get("BENCH_BLOB_HANDLER") == "1":

    @handler("bench.Blob", name="bench.blob")
    def blob(event, context) -> None:
        pass
