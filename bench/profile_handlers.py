"""Where benchmark 3's time goes: each statement of fan-out and delivery timed.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.profile_handlers [--events 50000]

``--events`` committed events, then ``fan_out()`` and ``deliver()`` to a no-op
handler, batches of 500, on one connection (claim-ahead off, so every statement
passes this connection's ``execute_wrapper``). Prints the two stages' wall
times and, per kind of statement, how many ran and the time in them; the
remainder of each stage is commits and Python.
"""

from __future__ import annotations

import argparse
import collections
import time

from django.core.management import call_command
from django.db import connection

from bench import bench_handlers, without_claim_ahead  # sets Django up
from outbox_app import relay
from outbox_app.fanout import fan_out

spent: collections.defaultdict[str, float] = collections.defaultdict(float)
runs: collections.Counter[str] = collections.Counter()


def kind(sql: str) -> str:
    """A short name for a statement of fan-out or delivery."""
    verb = sql.split(None, 1)[0]
    if verb == "INSERT":
        return "INSERT ... SELECT (notifications)"
    if verb == "SELECT":
        if "FOR UPDATE" in sql:
            return "SELECT ... FOR UPDATE (fan-out or claim)"
        return "SELECT (claimed rows with their events)"
    if verb == "UPDATE":
        table = sql.split('"')[1]
        return f"UPDATE {table}"
    return verb


def timer(execute, sql, params, many, context):
    began = time.perf_counter()
    try:
        return execute(sql, params, many, context)
    finally:
        spent[kind(sql)] += time.perf_counter() - began
        runs[kind(sql)] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=50_000)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    bench_handlers.prepare(args.events)
    with connection.execute_wrapper(timer), without_claim_ahead():
        began = time.perf_counter()
        fan_out(subscribers=[bench_handlers.HANDLER], batch_size=500)
        fanned = time.perf_counter()
        report = relay.deliver([bench_handlers.HANDLER], batch_size=500)
        ended = time.perf_counter()
    print(
        f"database: {connection.vendor}, {args.events:,} events: fan-out "
        f"{fanned - began:.2f} s ({args.events / (fanned - began):,.0f}/s), "
        f"delivery {ended - fanned:.2f} s "
        f"({report.succeeded / (ended - fanned):,.0f}/s)"
    )
    for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(
            f"{name:45} {runs[name]:6} x {seconds / runs[name] * 1e3:6.2f} ms "
            f"= {seconds:6.2f} s"
        )


if __name__ == "__main__":
    main()
