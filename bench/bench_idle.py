"""What an idle relay costs per subscriber: one ``relay_once`` turn on an
empty outbox, with 1 subscriber (the baseline, in the same run) and with
more, on the database of ``DATABASE_URL`` with a fresh project's default
settings (``bench.settings``).

    DATABASE_URL=mysql://root@127.0.0.1:3306/outbox_idle \\
        .venv/bin/python -m bench.bench_idle [--subscribers 1,10,30] [--calls 200]

A running relay makes such a turn at every wake-up or poll while nothing is
published. Each count runs in a process of its own (its handlers
registered there, recorded like a deploy's), after one warm-up turn.
Printed per turn: milliseconds of wall time and of the relay's CPU, the
statements sent (MySQL/MariaDB's session counter; PostgreSQL and SQLite
print "-"), and the wall time's ratio to the baseline's per subscriber.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def turn_costs(count: int, calls: int) -> dict[str, float | None]:
    """In this process: ``count`` no-op handlers, then ``calls`` idle turns."""
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings")
    import django

    django.setup()
    from django.core.management import call_command
    from django.db import connection

    from outbox_app import handler
    from outbox_app.models import Subscription
    from outbox_app.relay import relay_once
    from outbox_app.relay.loop import SubscriptionView
    from outbox_app.relay.registry import subscribers

    call_command("migrate", verbosity=0)
    for i in range(count):
        handler("bench.Idle", name=f"bench.idle.{i}")(lambda event, context: None)
    Subscription.objects.record(subscribers(), "bench_idle")

    def statements() -> int | None:
        if connection.vendor != "mysql":
            return None
        with connection.cursor() as cursor:
            cursor.execute("SHOW SESSION STATUS LIKE 'Questions'")
            return int(cursor.fetchone()[1])

    view = SubscriptionView("default")
    relay_once(view=view)  # warm-up: cursors taken, statements prepared
    before = statements()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        relay_once(view=view)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    after = statements()
    view.close()
    sent = None if before is None else (after - before - 1) / calls  # -1: SHOW
    return {"wall_ms": wall / calls * 1000, "cpu_ms": cpu / calls * 1000, "sent": sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--subscribers", default="1,10,30", help="counts, comma-separated"
    )
    parser.add_argument(
        "--calls", type=int, default=200, help="idle turns timed per count"
    )
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child process
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(turn_costs(args.one, args.calls)))
        return
    counts = sorted({1, *(int(c) for c in args.subscribers.split(","))})
    results = {}
    for count in counts:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.bench_idle",
                "--one",
                str(count),
                "--calls",
                str(args.calls),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        results[count] = json.loads(out.strip().splitlines()[-1])
    base = results[1]["wall_ms"]
    where = os.environ.get("DATABASE_URL", "sqlite")
    print(f"idle relay_once, {args.calls} turns each ({where})")
    print("subscribers   wall ms   CPU ms  statements  per subscriber / 1")
    for count, r in results.items():
        sent = "-" if r["sent"] is None else f"{r['sent']:.1f}"
        ratio = r["wall_ms"] / count / base
        wall, cpu = r["wall_ms"], r["cpu_ms"]
        print(f"{count:>11}  {wall:>8.2f}  {cpu:>7.2f}  {sent:>10}  {ratio:>17.2f}x")


if __name__ == "__main__":
    main()
