"""A relay worker process for the crash and concurrency tests.

    python -m tests.relay_worker SET [SET ...] [--until-done] [--max-seconds N]
        [--stall-after REGEX]

Registers the handler sets of ``tests.testapp.scenarios``, holds the SQLite
single-relay guard, then runs the relay until everything is delivered
(``--until-done``) or the time is up. Prints ``ready`` once it holds the guard.

``--stall-after REGEX`` freezes the process (SIGSTOP, as a GC pause or a
network partition would) right after it first sends a statement matching
REGEX, having written ``$OUTBOX_TEST_MARKER``: whatever the relay holds at
that point stays held until the test kills it.
"""

import argparse
import os
import re
import signal
import sys
import time

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from django.db import close_old_connections  # noqa: E402
from django.db.backends.signals import connection_created  # noqa: E402

from outbox_app import Delivery, OutboxEvent  # noqa: E402
from outbox_app.ops import streams  # noqa: E402
from outbox_app.relay import relay_once  # noqa: E402
from outbox_app.relay.worker import single_relay_guard  # noqa: E402
from outbox_app.store.lifecycle import State  # noqa: E402
from tests.testapp import scenarios  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("sets", nargs="+")
    parser.add_argument("--until-done", action="store_true")
    parser.add_argument("--max-seconds", type=float, default=120)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--stall-after", default=None)
    args = parser.parse_args()
    if args.stall_after:
        stall_after(re.compile(args.stall_after, re.S))
    for name in args.sets:
        scenarios.register(name)
    deadline = time.monotonic() + args.max_seconds
    with single_relay_guard("default"):
        print("ready", flush=True)
        while time.monotonic() < deadline:
            report = relay_once(batch_size=args.batch_size, max_seconds=5)
            close_old_connections()
            if report.claimed or report.fanned_out:
                continue
            if args.until_done and not (
                OutboxEvent.objects.awaiting_fanout().exists()
                or Delivery.objects.exclude(state=State.SUCCEEDED).exists()
                or streams.awaited()
            ):
                return 0
            time.sleep(0.02)
    return 0 if not args.until_done else 3


def stall_after(pattern: re.Pattern) -> None:
    """SIGSTOP this process after its first statement matching ``pattern``."""

    def wrapper(execute, sql, params, many, context):
        result = execute(sql, params, many, context)
        if pattern.search(sql):
            with open(os.environ["OUTBOX_TEST_MARKER"], "w") as marker:
                marker.write(sql)
            os.kill(os.getpid(), signal.SIGSTOP)
        return result

    def install(sender, connection, **kwargs):
        connection.execute_wrappers.append(wrapper)

    connection_created.connect(install, weak=False)


if __name__ == "__main__":
    sys.exit(main())
