"""What OpenTelemetry support costs ``publish()``: nothing without the
package, little with it.

Command (a migrated ``outbox_bench`` database)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_tracing

A commit of one ``publish()`` of one event, timed from entering
``transaction.atomic()`` to its return, in turns over ``--rounds`` rounds of
``--commits`` commits per mode:

- ``absent``: without opentelemetry-api (the process cannot import
  ``opentelemetry``, as where the package is not installed): the baseline;
- ``api``: the API installed, no tracer provider configured (the API's no-op);
- ``sdk``: the SDK's tracer provider with an in-memory exporter, set as the
  process's, each commit inside a recording span, so ``publish()`` opens
  its span and ``traceparent``/``tracestate`` are injected and stored.

Each mode's commits run in a process of their own (started per round, 100
commits of warm-up, the table emptied after), so ``absent`` is a process
where the package is missing. Printed: median and 99th percentile per mode,
and the ratio to ``absent``. The ``sdk`` figure includes the span the
benchmark itself opens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("absent", "api", "sdk")


def commits(n: int, tracer=None) -> list[float]:
    from django.db import transaction

    from bench.benchapp.events import OrderPlaced
    from outbox_app import publish

    times = []
    for i in range(n):
        began = time.perf_counter()
        if tracer is None:
            with transaction.atomic():
                publish(OrderPlaced(order_id=i, total=1))
        else:
            with tracer.start_as_current_span("request"), transaction.atomic():
                publish(OrderPlaced(order_id=i, total=1))
        times.append(time.perf_counter() - began)
    return times


def child(mode: str, count: int) -> None:
    """One mode's commits in this process; prints the vendor and the seconds
    per commit as JSON."""
    if mode == "absent":
        sys.modules["opentelemetry"] = None  # import fails: not installed
    os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"
    import django

    django.setup()
    from django.db import connection

    from bench import clear

    tracer = None
    if mode == "sdk":
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
        from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
            InMemorySpanExporter,
        )

        sdk = TracerProvider()
        sdk.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
        # The process's provider, as a project configures it: publish()
        # opens its own span then.
        trace.set_tracer_provider(sdk)
        tracer = sdk.get_tracer("bench")
    commits(100, tracer)  # warm up
    times = commits(count, tracer)
    clear()
    print(json.dumps({"vendor": connection.vendor, "times": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        child(args.mode, args.commits)
        return
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            command = ["bench.bench_tracing", "--mode", mode, "--commits"]
            out = subprocess.run(
                [sys.executable, "-m", *command, str(args.commits)],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            found = json.loads(out.splitlines()[-1])
            samples[mode] += found["times"]
    print(f"{found['vendor']}: {args.rounds} rounds of {args.commits} commits")
    base = statistics.median(samples["absent"])
    print(f"{'mode':<7} {'median ms':>10} {'p99 ms':>8} {'vs absent':>10}")
    for mode, times in samples.items():
        times = sorted(times)
        median = statistics.median(times)
        p99 = times[int(len(times) * 0.99)]
        ratio = median / base
        print(f"{mode:<7} {median * 1000:>10.3f} {p99 * 1000:>8.3f} {ratio:>9.2f}x")


if __name__ == "__main__":
    main()
