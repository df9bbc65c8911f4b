"""``python manage.py outbox_health``: a liveness or readiness probe of a
``relay`` or ``consume`` process, read from its ``--health-file``."""

from __future__ import annotations

import sys

from django.core.management.base import CommandError

from outbox_app.exceptions import HealthFileUnreadable
from outbox_app.health import MAX_AGE_SECONDS, read_health
from outbox_app.management.base import OutboxCommand


class Command(OutboxCommand):
    help = (
        "Probe a relay or consume process through its --health-file: exit 0 "
        "when it is alive (its loop turned within --max-age seconds) and, with "
        "--ready, ready (database reachable; relay: no publisher paused; "
        "consume: broker connected); else exit 1 with the reason on stderr. "
        "Reads the file only (no database query): a Kubernetes exec probe."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--file",
            required=True,
            metavar="PATH",
            help="The health file the process writes (its --health-file).",
        )
        parser.add_argument(
            "--max-age",
            type=float,
            default=MAX_AGE_SECONDS,
            metavar="SECONDS",
            help="Alive when the last loop turn is at most this old (default: "
            f"{MAX_AGE_SECONDS:g}). Longer than OUTBOX_POLL_INTERVAL_SECONDS and than "
            "the longest batch of handlers or consumers.",
        )
        parser.add_argument(
            "--ready",
            action="store_true",
            help="Also require the process to be ready (a readiness probe).",
        )

    def handle(self, *args, **options):
        if options["max_age"] <= 0:
            raise CommandError("--max-age must be a positive number of seconds")
        try:
            problem = read_health(options["file"]).problem(
                options["max_age"], options["ready"]
            )
        except HealthFileUnreadable as exc:
            problem = str(exc)
        if problem:
            self.stderr.write(problem)
            sys.exit(1)
        if options["verbosity"] >= 2:
            self.stdout.write("ready" if options["ready"] else "alive")
