"""Where benchmark 3's time goes: each stage of fan-out and delivery timed.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.profile_handlers [--events 50000]

``--events`` committed events, then ``fan_out()`` and ``deliver()`` to a no-op
handler, batches of 500, as ``bench.bench_handlers.outbox`` runs them (the
next batch claimed ahead on a second connection), under Python's profiler in
every thread, each stage's wall time read from it (``bench.Stopwatch``):
``Gateway.fan_out`` (one statement per
batch on PostgreSQL), ``Batch.claim`` / ``Gateway.claim`` (claim and read the
rows, mostly on the claim-ahead thread), ``ClaimAhead.take`` (the wait for
it), ``run_handlers`` (a batch's groups: savepoint-free handler calls, then
``Gateway.succeed`` marking each group), ``Gateway.renew`` and the commits.
Prints the two stages' wall times and, per stage, calls, seconds and
microseconds per event; nested stages are counted in their parent too. The
profiler slows Python code (decoding reads about 2x its unprofiled time), not
the database's statements.

The stages watched are row delivery's (fan-out, claims, claim-ahead, the
SUCCEEDED marks): the run is made with ``OUTBOX_ENGINE = "rows"``, whatever
the default engine.
"""

from __future__ import annotations

import argparse
import time

from django.core.management import call_command
from django.db import connection, connections
from django.test.utils import override_settings

from bench import Stopwatch, bench_handlers  # bench_handlers sets Django up
from outbox_app.execution import run
from outbox_app.relay import deliver, fan_out, loop
from outbox_app.relay.batch import Batch, ClaimAhead
from outbox_app.store.gateway import Gateway


@override_settings(OUTBOX_ENGINE="rows")
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    bench_handlers.prepare(args.events)
    watch = Stopwatch()
    watch.watch(Gateway.fan_out, "Gateway.fan_out")
    watch.watch(Batch.claim, "Batch.claim (claim + read)")
    watch.watch(Gateway.claim, "  Gateway.claim")
    watch.watch(ClaimAhead.take, "ClaimAhead.take (waiting for the claim-ahead)")
    watch.watch(loop.run_handlers, "run_handlers, of which:")
    watch.watch(run.event_for, "  decode the event (event_for)")
    watch.watch(Gateway.succeed, "  Gateway.succeed (a group's UPDATE)")
    watch.watch(Gateway.renew, "  Gateway.renew")
    watch.watch(type(connections["default"]).commit, "COMMIT (any)")
    with watch.running():
        began = time.perf_counter()
        fanned = fan_out(subscribers=[bench_handlers.HANDLER], batch_size=500)
        middle = time.perf_counter()
        report = deliver([bench_handlers.HANDLER], batch_size=500)
        ended = time.perf_counter()
    assert fanned == report.succeeded == args.events, (fanned, report)
    print(
        f"database: {connection.vendor}, row delivery, {args.events:,} events: fan-out "
        f"{middle - began:.2f} s ({args.events / (middle - began):,.0f}/s), "
        f"delivery {ended - middle:.2f} s "
        f"({report.succeeded / (ended - middle):,.0f}/s)"
    )
    watch.report(ended - began, args.events)


if __name__ == "__main__":
    main()
