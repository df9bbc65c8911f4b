"""Benchmark 3: in-process handlers, one worker, a no-op handler.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m bench.bench_handlers [--events 100000] [--rounds 3]
        [--on-commit]

``--on-commit``: the handler does its work (a counter) in a
``transaction.on_commit`` callback, which the relay runs after the group's
commit and before the row's mark.

Per round, on the same database, interleaved:

* **outbox_app**: ``deliver()`` of one handler over ``--events`` committed
  events published after it was recorded, batches of ``--batch-size``: what
  one ``manage.py relay`` process does, with the default delivery engine
  (stream on PostgreSQL and SQLite: the handler's cursor reads the events,
  no delivery row is written for a success, and ``fan_out()`` has nothing to
  do). Handlers share one transaction per group
  (``OUTBOX_HANDLER_GROUP_SECONDS``), each in a savepoint; the group's
  commit records its outcome (with stream delivery, the cursor's move).
* **row delivery**: the same with ``OUTBOX_ENGINE = "rows"``: ``fan_out()``
  writes a delivery row per event, then the batches are claimed (the next one
  ahead, on a second connection) and one UPDATE marks each group;
* **one commit per delivery**: outbox_app with
  ``OUTBOX_HANDLER_GROUP_SECONDS = 0``, so every handler gets its own
  transaction and outcome, as outbox_app did before group commits;
* **one row per transaction**: the usual outbox loop over delivery rows
  (fanned out with ``OUTBOX_ENGINE = "rows"``), per row a transaction
  that locks one due row (``FOR UPDATE SKIP LOCKED LIMIT 1`` where supported),
  runs the handler and marks the row.

The two baselines run on ``--baseline-events`` (default 5,000): their rate does
not depend on the backlog, and 100,000 rows at their pace would take minutes.
Prints deliveries/s (medians) and ratios; ``--plot NAME`` saves bench/NAME.png.
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
from django.test.utils import override_settings  # noqa: E402
from django.utils import timezone  # noqa: E402

from bench import (  # noqa: E402
    clear,
    engine,
    lock_skipping_locked,
    record,
    summarize,
    vacuum,
)
from outbox_app import Delivery, publish  # noqa: E402
from outbox_app.events.codec import decode  # noqa: E402
from outbox_app.relay import deliver, fan_out  # noqa: E402
from outbox_app.store.lifecycle import State  # noqa: E402
from outbox_app.subscribers import Handler  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402

seen = 0


#: --on-commit: the handler counts from a transaction.on_commit callback.
ON_COMMIT = False


def count() -> None:
    global seen
    seen += 1


def noop(event, context) -> None:
    if ON_COMMIT:
        transaction.on_commit(count)
    else:
        count()


HANDLER = Handler(name="bench.noop", event_types=frozenset({"OrderPlaced"}), fn=noop)


def prepare(events: int) -> None:
    """``events`` committed OrderPlaced events, published after the handler
    was recorded (its cursor starts before them, with stream delivery), not
    fanned out; nothing else."""
    clear()
    record(HANDLER)
    for start in range(0, events, 1000):
        with transaction.atomic():
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i))
                    for i in range(start, min(events, start + 1000))
                ]
            )
    vacuum()


def outbox(events: int, batch_size: int) -> tuple[float, float]:
    """(deliveries/s including fan-out, seconds spent fanning out: none with
    stream delivery)."""
    global seen
    prepare(events)
    seen = 0
    started = time.perf_counter()
    fanned = fan_out(subscribers=[HANDLER], batch_size=batch_size)
    fanned_at = time.perf_counter()
    report = deliver([HANDLER], batch_size=batch_size)
    elapsed = time.perf_counter() - started
    assert fanned == (events if engine() == "rows" else 0), fanned
    assert report.succeeded == events == seen, (report, seen)
    return events / elapsed, fanned_at - started


def row_delivery(events: int, batch_size: int) -> tuple[float, float]:
    """:func:`outbox` with ``OUTBOX_ENGINE = "rows"``."""
    with override_settings(OUTBOX_ENGINE="rows"):
        return outbox(events, batch_size)


def one_commit_per_delivery(events: int, batch_size: int) -> float:
    with override_settings(OUTBOX_HANDLER_GROUP_SECONDS=0):
        return outbox(events, batch_size)[0]


@override_settings(OUTBOX_ENGINE="rows")
def one_row_per_transaction(events: int) -> float:
    global seen
    prepare(events)
    fan_out(subscribers=[HANDLER], batch_size=1000)
    seen = 0
    due = Delivery.objects.filter(state=State.PENDING).order_by("id")
    started = time.perf_counter()
    while True:
        with transaction.atomic():
            row = lock_skipping_locked(due.select_related("event")).first()
            if row is None:
                break
            event = row.event
            noop(decode(event.event_type, event.revision, event.payload), row)
            Delivery.objects.filter(id=row.id).update(
                state=State.SUCCEEDED, completed_at=timezone.now(), attempts=1
            )
    elapsed = time.perf_counter() - started
    assert seen == events
    return events / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--baseline-events", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--plot", help="save the medians as bench/<PLOT>.png")
    parser.add_argument(
        "--on-commit",
        action="store_true",
        help="the handler registers a transaction.on_commit callback",
    )
    args = parser.parse_args()
    global ON_COMMIT
    ON_COMMIT = args.on_commit
    call_command("migrate", verbosity=0)
    rates: dict[str, list[float]] = {
        "one row per transaction": [],
        "one commit per delivery": [],
        "row delivery": [],
        "outbox_app": [],
    }
    fanning: list[float] = []
    for round_ in range(args.rounds):
        rates["one row per transaction"].append(
            one_row_per_transaction(args.baseline_events)
        )
        rates["one commit per delivery"].append(
            one_commit_per_delivery(args.baseline_events, args.batch_size)
        )
        rate, fan_seconds = row_delivery(args.events, args.batch_size)
        rates["row delivery"].append(rate)
        fanning.append(fan_seconds)
        rates["outbox_app"].append(outbox(args.events, args.batch_size)[0])
        print(
            f"round {round_ + 1}: "
            + ", ".join(f"{k} {v[-1]:,.0f}/s" for k, v in rates.items())
            + f" (row delivery's fan-out {fan_seconds:.1f} s of it)",
            flush=True,
        )
    medians = {k: statistics.median(v) for k, v in rates.items()}
    base = medians["one row per transaction"]
    print(
        f"database: {connection.vendor}, {args.events:,} events "
        f"(baselines {args.baseline_events:,}), batch size {args.batch_size}, "
        f"{args.rounds} rounds; outbox_app: {engine()} delivery; row delivery's "
        f"fan-out took {statistics.median(fanning):.1f} s"
    )
    summarize(
        medians,
        base,
        column="relay (ratio: to one row per transaction)",
        unit="deliveries/s",
        title=f"No-op handler, one worker ({connection.vendor})",
        plot=args.plot,
    )
    clear()


if __name__ == "__main__":
    main()
