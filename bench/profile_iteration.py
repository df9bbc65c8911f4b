"""How long one relay iteration takes for a single event: benchmark 4's latency.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.profile_iteration [--events 300] [--per-commit 1]

Per round: commit ``--per-commit`` events, then time, in this process, what a
woken relay does: ``fan_out()``, ``deliver()`` to a no-op handler, and the
empty ``fan_out()`` + ``deliver()`` after it (the relay looks once more before
it sleeps). Prints the median and p90 of each, in milliseconds, and the number
of statements of the first two (commits not counted). The first 20 rounds warm
up and are left out. The handler is recorded before the first event (with
stream delivery, the default on PostgreSQL and SQLite, its cursor starts
then, and ``fan_out()`` has nothing to do).
"""

from __future__ import annotations

import argparse
import decimal
import os
import statistics
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.core.management import call_command  # noqa: E402
from django.db import connection, transaction  # noqa: E402

from bench import clear, engine, record  # noqa: E402
from outbox_app import publish  # noqa: E402
from outbox_app.relay import deliver, fan_out  # noqa: E402
from outbox_app.subscribers import Handler  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402

HANDLER = Handler(
    name="bench.iteration",
    event_types=frozenset({"OrderPlaced"}),
    fn=lambda event, context: None,
)
WARM_UP = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300)
    parser.add_argument("--per-commit", type=int, default=1)
    args = parser.parse_args()
    call_command("migrate", verbosity=0)
    clear()
    record(HANDLER)
    steps: dict[str, list[float]] = {
        "fan_out()": [],
        "deliver()": [],
        "empty fan_out() + deliver()": [],
    }
    statements: list[int] = []
    count = 0

    def counted(execute, sql, params, many, context):
        nonlocal count
        count += 1
        return execute(sql, params, many, context)

    for round_ in range(args.events + WARM_UP):
        with transaction.atomic():
            publish(
                *[
                    OrderPlaced(order_id=round_, total=decimal.Decimal(1))
                    for _ in range(args.per_commit)
                ]
            )
        count = 0
        with connection.execute_wrapper(counted):
            began = time.perf_counter()
            fan_out(subscribers=[HANDLER])
            fanned = time.perf_counter()
            report = deliver([HANDLER])
            delivered = time.perf_counter()
            used = count
            fan_out(subscribers=[HANDLER])
            deliver([HANDLER])
            ended = time.perf_counter()
        assert report.succeeded == args.per_commit, report
        if round_ >= WARM_UP:
            steps["fan_out()"].append((fanned - began) * 1e3)
            steps["deliver()"].append((delivered - fanned) * 1e3)
            steps["empty fan_out() + deliver()"].append((ended - delivered) * 1e3)
            statements.append(used)
    print(
        f"database: {connection.vendor}, {args.events} rounds of "
        f"{args.per_commit} event(s), {engine()} delivery; "
        f"{statistics.median(statements):.0f} "
        "statements for fan_out() + deliver()"
    )
    for name, ms in steps.items():
        ms.sort()
        print(
            f"{name:30} median {statistics.median(ms):6.2f} ms  "
            f"p90 {ms[int(len(ms) * 0.9)]:6.2f} ms"
        )


if __name__ == "__main__":
    main()
