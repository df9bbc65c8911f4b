"""Issue 15: what OpenTelemetry support costs ``publish()``: nothing without
the package, little with it.

Command (a migrated ``outbox_bench`` database)::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_tracing

A commit of one ``publish()`` of one event, timed from entering
``transaction.atomic()`` to its return, in turns over ``--rounds`` rounds of
``--commits`` commits per mode:

- ``absent``: ``outbox_app.execution.tracing`` as without opentelemetry-api installed
  (its ``trace`` module set to None): the baseline;
- ``api``: the API installed, no tracer provider configured (the API's no-op);
- ``sdk``: the SDK's tracer provider with an in-memory exporter, each commit
  inside a recording span, so ``traceparent``/``tracestate`` are injected and
  stored.

Printed: median and 99th percentile per mode, and the ratio to ``absent``.
The ``sdk`` figure includes the span the benchmark itself opens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["DJANGO_SETTINGS_MODULE"] = "bench.settings"

import django

django.setup()

from django.db import connection, transaction  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)

from bench import clear  # noqa: E402
from bench.benchapp.events import OrderPlaced  # noqa: E402
from outbox_app import publish  # noqa: E402
from outbox_app.execution import tracing  # noqa: E402


def commits(n: int, tracer=None) -> list[float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--commits", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    installed = tracing.trace
    sdk = TracerProvider()
    exporter = InMemorySpanExporter()
    sdk.add_span_processor(SimpleSpanProcessor(exporter))
    print(f"{connection.vendor}: {args.rounds} rounds of {args.commits} commits")
    clear()
    commits(100)  # warm up
    samples: dict[str, list[float]] = {"absent": [], "api": [], "sdk": []}
    for _ in range(args.rounds):
        tracing.trace = None
        samples["absent"] += commits(args.commits)
        tracing.trace = installed
        samples["api"] += commits(args.commits)
        samples["sdk"] += commits(args.commits, sdk.get_tracer("bench"))
        exporter.clear()
        clear()
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
