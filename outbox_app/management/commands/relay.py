"""``python manage.py relay``: deliver committed outbox events."""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import BaseCommand, CommandError
from django.db import connections

from outbox_app.exceptions import OutboxError
from outbox_app.execution.metrics import relay_metrics
from outbox_app.health import HealthFile
from outbox_app.management.base import OutboxCommand
from outbox_app.relay import RelayReport
from outbox_app.relay.worker import RelayWorker
from outbox_app.store.models import Delivery, OutboxEvent

KINDS = {"publishers": "publisher", "handlers": "handler"}


def add_health_file_argument(parser, ready: str) -> None:
    """``--health-file PATH`` of a long-running command; ``ready``: what its
    readiness means."""
    parser.add_argument(
        "--health-file",
        metavar="PATH",
        help="Rewrite this file at every loop turn (atomically, at least once "
        'a second) with {"alive_at": epoch seconds, "ready": bool, "why": '
        f"text}}; ready: {ready}. Removed on a clean stop. "
        "manage.py outbox_health --file PATH reads it (a liveness or "
        "readiness probe).",
    )


def health_file(path: str | None) -> HealthFile | None:
    """The :class:`HealthFile` of ``--health-file``, its directory checked.

    Raises:
        CommandError: the directory does not exist or is not writable.
    """
    if path is None:
        return None
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise CommandError(
            f"--health-file: the directory {directory} does not exist or is "
            "not writable"
        )
    return HealthFile(path)


def configure_logging(verbosity: int) -> None:
    """The ``outbox_app`` loggers for a long-running command (``relay``,
    ``consume``): ``-v 0``: warnings and errors; ``-v 1`` (default): also
    start-up and state changes (a backlog found or drained, a publisher paused
    or resumed, stopping); ``-v 2`` and up: every iteration and wake-up.

    A handler is added only when no logger on the way to the root has one
    (Django's default logging configures none there): a project's own
    ``LOGGING`` prints each record once, with its format."""
    logger = logging.getLogger("outbox_app")
    levels = {0: logging.WARNING, 1: logging.INFO}
    logger.setLevel(levels.get(verbosity, logging.DEBUG))
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s")
        )
        logger.addHandler(handler)


class Command(OutboxCommand):
    help = (
        "Run the outbox relay: fan committed events out to their subscribers and "
        "deliver them to broker publishers and in-process handlers, with retries, "
        "backoff and leases. Runs until SIGTERM/SIGINT (finishing the current "
        "batch and releasing unstarted rows), or with --once until nothing is due. "
        "Several relays may run side by side on PostgreSQL and MySQL/MariaDB; "
        "SQLite allows one per database file."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--only",
            choices=sorted(KINDS),
            help="Deliver to publishers or to handlers only (fan-out always runs), "
            "to split them across processes. Default: both.",
        )
        parser.add_argument(
            "--batch-size",
            type=int,
            default=None,
            help="Rows per claim (default: OUTBOX_BATCH_SIZE).",
        )
        parser.add_argument(
            "--database",
            default="default",
            choices=list(connections),
            help="Database alias whose outbox to relay (default: default).",
        )
        parser.add_argument(
            "--max-seconds",
            type=float,
            default=None,
            help="Exit 0 after this many seconds (default: run until stopped).",
        )
        parser.add_argument(
            "--metrics-port",
            type=int,
            metavar="PORT",
            help="Serve this relay's Prometheus metrics (outcomes, failures by "
            "error class, batch durations, publish-to-delivery latency, paused "
            "publishers) on this port, at /metrics (needs "
            "outbox_app[prometheus]). The outbox's own numbers (backlog, lag) "
            "come from outbox_app.ops.metrics.metrics_view.",
        )
        add_health_file_argument(
            parser, "the last turn reached the database and no publisher is paused"
        )
        parser.add_argument(
            "--metrics-host",
            default="127.0.0.1",
            metavar="ADDRESS",
            help="The address --metrics-port binds (default: %(default)s, this "
            "machine only; the server checks no credentials). 0.0.0.0 or :: "
            "for every interface, e.g. for a Prometheus in another container.",
        )
        parser.add_argument(
            "--once",
            action="store_true",
            help="Deliver what is due now, print a summary and exit.",
        )

    def handle(self, *args, **options):
        if options["batch_size"] is not None and options["batch_size"] < 1:
            raise CommandError("--batch-size must be a positive number of rows")
        configure_logging(options["verbosity"])
        if options["metrics_port"] is not None:
            try:
                relay_metrics.enable(
                    options["metrics_port"], addr=options["metrics_host"]
                )
            except (ImproperlyConfigured, OSError) as exc:
                raise CommandError(f"--metrics-port: {exc}") from exc
        health = health_file(options["health_file"])
        using = options["database"]
        progress = _Progress(self, using) if options["once"] else None
        worker = RelayWorker(
            kind=KINDS.get(options["only"]),
            using=using,
            batch_size=options["batch_size"],
            max_seconds=options["max_seconds"],
            once=options["once"],
            on_iteration=progress,
            health=health,
        )
        previous = {
            sig: signal.signal(sig, worker.stop)
            for sig in (signal.SIGTERM, signal.SIGINT)
        }
        started = time.monotonic()
        try:
            report = worker.run()
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if options["once"] or options["verbosity"] >= 1:
            self._summary(report, time.monotonic() - started)

    def _summary(self, report: RelayReport, elapsed: float) -> None:
        done = report.succeeded + report.failed + report.dead
        rate = done / elapsed if elapsed > 0 else 0.0
        self.stdout.write(
            f"delivered {report.succeeded}, failed {report.failed}, "
            f"dead {report.dead}, "
            + (f"lapsed {report.lapsed}, " if report.lapsed else "")
            + f"fanned out {report.fanned_out}, "
            f"lost leases {report.lost}, released {report.released}; "
            f"{elapsed:.1f}s, {rate:.0f} deliveries/s"
        )


class _Progress:
    """A text progress bar for ``--once``: outcomes written against the work
    that was due when the run started."""

    WIDTH = 30

    def __init__(self, command: BaseCommand, using: str):
        self.command = command
        due = Delivery.objects.using(using).due().count()
        waiting = OutboxEvent.objects.using(using).awaiting_fanout().count()
        self.total = max(due + waiting, 1)
        self.done = 0

    def __call__(self, report: RelayReport) -> None:
        self.done += report.succeeded + report.failed + report.dead + report.lapsed
        share = min(1.0, self.done / self.total)
        filled = int(share * self.WIDTH)
        bar = "#" * filled + "." * (self.WIDTH - filled)
        self.command.stdout.write(f"[{bar}] {self.done} outcomes ({share:.0%} of due)")
