"""Scale: claim latency with 10,000 and with 1,000,000 finished rows in the tables.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench1 \\
        .venv/bin/python -m bench.bench_scale [--small 10000] [--large 1000000]

History (SUCCEEDED deliveries and their delivered events) is generated in the
database (``generate_series`` on PostgreSQL, the ``seq_1_to_N`` sequence table on
MariaDB). 2,000 due PENDING rows of the benchmark subscriber sit on top. A claim
is ``Gateway().claim([subscriber], limit=100, ...)``
(``outbox_app.store.gateway``: the relay's claim, rows and payloads read);
10 claims take 1,000 rows, then the rows are put back (outside the clock).
Unordered and ordered (each aggregate's head) claims are measured. The history
grows from ``--small`` to ``--large`` rows between the two phases; the
ratio is large / small, goal <= 1.3 on PostgreSQL.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection  # noqa: E402

from outbox_app import Delivery, OutboxEvent  # noqa: E402

SUBSCRIBER = "bench1-scale"
EVENT_TYPE = "bench1.Rss"
DUE = 2000


def add_rows(count: int, marker: str, state: str | None) -> None:
    """``count`` events (namespace ``marker``) and one delivery each, in SQL;
    with ``state=None``, ``bench1.Rss`` events awaiting fan-out and no delivery."""
    events, deliveries = OutboxEvent._meta.db_table, Delivery._meta.db_table
    if connection.vendor == "postgresql":
        numbers, uuid, now = (
            f"generate_series(1, {count}) AS s(n)",
            "gen_random_uuid()",
            "now()",
        )
        past = "now() - interval '1 minute'"
        text = "n::text"
    else:
        numbers, uuid, now = f"seq_1_to_{count} AS s", "UUID()", "UTC_TIMESTAMP(6)"
        past = "UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE"
        text = "CAST(seq AS CHAR)"
    finished = state == "SUCCEEDED"
    event_type = EVENT_TYPE if state is None else "testapp.OrderPlaced"
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {events} (id, namespace, event_type, revision,"
            " aggregate_type, aggregate_id, payload, headers, occurred_at,"
            " created_at, fanned_out)"
            f" SELECT {uuid}, '{marker}', '{event_type}', 1, 'testapp.Order',"
            f" {text}, '{{}}', '{{}}', {now}, {now}, {state is not None}"
            f" FROM {numbers}"
        )
        cursor.execute(
            "SELECT 1"
            if state is None
            else f"INSERT INTO {deliveries} (event_id, subscriber, event_type,"
            " aggregate_type, aggregate_id, state, attempts, next_retry_at, locked_by,"
            " last_error, last_error_type, last_traceback, completed_at, created_at,"
            " updated_at)"
            f" SELECT id, '{SUBSCRIBER}', event_type, aggregate_type, aggregate_id,"
            f" '{state}', {int(finished)}, {past}, '', '', '', '',"
            f" {now if finished else 'NULL'}, {now}, {now}"
            f" FROM {events} WHERE namespace = '{marker}'"
        )
        analyze = "ANALYZE" if connection.vendor == "postgresql" else "ANALYZE TABLE"
        cursor.execute(f"{analyze} {events}")
        cursor.execute(f"{analyze} {deliveries}")


def claims(ordered: bool, passes: int) -> list[float]:
    """Seconds per claim of 100 rows."""
    from django.utils import timezone

    from outbox_app.store.gateway import Gateway

    gateway = Gateway()
    times = []
    for _ in range(passes):
        for _ in range(DUE // 200):
            began = time.perf_counter()
            _, claimed = gateway.claim(
                [SUBSCRIBER],
                limit=100,
                lease_seconds=60,
                worker="bench1",
                now=timezone.now(),
                ordered=ordered,
            )
            times.append(time.perf_counter() - began)
            assert len(claimed) == 100, len(claimed)
        Delivery.objects.filter(subscriber=SUBSCRIBER, state="RUNNING").update(
            state="PENDING",
            lease_token=None,
            locked_until=None,
            next_retry_at=timezone.now() - timezone.timedelta(minutes=1),
        )
    return times


def measure(passes: int) -> dict[str, float]:
    claims(False, 1)  # warm the caches
    result = {}
    for ordered in (False, True):
        ms = [t * 1e3 for t in claims(ordered, passes)]
        ms.sort()
        name = "ordered" if ordered else "unordered"
        result[name] = statistics.median(ms)
        result[name + " p90"] = ms[int(len(ms) * 0.9)]
    return result


def drain() -> None:
    """The relay process: a no-op handler, ``relay --once``, then its peak RSS.

    ``VmHWM`` rather than ``ru_maxrss``: Linux carries ``ru_maxrss`` across
    fork+exec, so a child would report its parent's peak if that was higher.
    """
    from outbox_app import handler
    from outbox_app.relay.worker import RelayWorker

    handler(EVENT_TYPE, name="bench1-rss")(lambda event, context: None)
    report = RelayWorker(kind="handler", once=True).run()
    status = Path("/proc/self/status").read_text()
    peak_kb = int(status.split("VmHWM:")[1].split()[0])
    print(f"{report.succeeded} {peak_kb}")


def rss(counts: list[int]) -> dict[int, float]:
    """Peak RSS in MB of a relay process draining each of ``counts`` events."""
    import subprocess
    import sys

    peaks = {}
    for count in counts:
        Delivery.objects.all().delete()
        OutboxEvent.objects.all().delete()
        add_rows(count, f"bench1-rss{count}", None)
        began = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-m", "bench.bench_scale", "--drain"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        delivered, peak_kb = int(out[-2]), int(out[-1])
        peaks[count] = peak_kb / 1024
        print(
            f"drained {delivered:,} of {count:,} events in "
            f"{time.perf_counter() - began:.0f} s, peak RSS {peaks[count]:.1f} MB",
            flush=True,
        )
    return peaks


def main() -> None:
    if sys.argv[1:2] == ["--drain"]:
        return drain()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", type=int, default=10_000)
    parser.add_argument("--large", type=int, default=1_000_000)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--plot", default=f"bench_scale_{connection.vendor}")
    parser.add_argument("--rss", help="event counts to drain, e.g. 100000,300000")
    parser.add_argument("--rss-plot", default=f"bench_rss_{connection.vendor}")
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    if args.rss:
        peaks = rss([int(n) for n in args.rss.split(",")])
        from bench.plot import bars

        bars(
            args.rss_plot,
            f"Relay peak RSS draining N events on {connection.vendor} (goal < 150 MB)",
            "MB (VmHWM)",
            [f"{n:,}" for n in peaks],
            {"peak RSS": list(peaks.values())},
        )
        return
    Delivery.objects.all().delete()
    OutboxEvent.objects.all().delete()
    add_rows(DUE, "bench1-due", "PENDING")
    add_rows(args.small, "bench1-hist0", "SUCCEEDED")
    phases = {}
    phases[args.small] = measure(args.passes)
    print(f"{args.small:>9,} finished rows: {phases[args.small]}", flush=True)
    began = time.perf_counter()
    rest, step = args.large - args.small, 250_000
    for i, start in enumerate(range(0, rest, step)):
        add_rows(min(step, rest - start), f"bench1-hist{i + 1}", "SUCCEEDED")
    print(f"(history grown in {time.perf_counter() - began:.0f} s)", flush=True)
    phases[args.large] = measure(args.passes)
    print(f"{args.large:>9,} finished rows: {phases[args.large]}")
    for name in ("unordered", "ordered"):
        small, large = phases[args.small][name], phases[args.large][name]
        print(f"{name}: {small:.2f} ms -> {large:.2f} ms, ratio {large / small:.2f}")
    from bench.plot import bars

    bars(
        args.plot,
        f"Claim of 100 rows on {connection.vendor}: median ms (lower is better)",
        "milliseconds per claim",
        ["unordered", "ordered"],
        {
            f"{n:,} finished rows": [phases[n]["unordered"], phases[n]["ordered"]]
            for n in phases
        },
    )


if __name__ == "__main__":
    main()
