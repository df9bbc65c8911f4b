"""``manage.py outbox_purge``: delete finished outbox rows older than the
retention (``outbox_app.ops.purge``)."""

from __future__ import annotations

import time

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS
from django.template.defaultfilters import pluralize

from outbox_app.conf import outbox_settings
from outbox_app.management.base import OutboxCommand
from outbox_app.ops import purge


def _days(text: str) -> float:
    value = float(text)
    if value < 0:
        raise ValueError(text)
    return value


_days.__name__ = "number of days"


def _ratio(text: str) -> float:
    return _days(text)


_ratio.__name__ = "non-negative number"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


_positive.__name__ = "positive integer"


class Command(OutboxCommand):
    help = (
        "Delete finished outbox rows older than the retention: SUCCEEDED "
        "deliveries, events whose every delivery succeeded, and sentinel rows. "
        "Never deletes PENDING, RUNNING, FAILED or DEAD deliveries, events "
        "that still have one, nor events not fanned out yet. Deletes in batches "
        "(one short transaction each); safe to interrupt and rerun."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--older-than",
            type=_days,
            metavar="DAYS",
            help="Retention in days (default: OUTBOX_RETENTION_DAYS, now "
            f"{outbox_settings.RETENTION_DAYS}). 0 purges every finished row.",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count what would be deleted; delete nothing.",
        )
        parser.add_argument(
            "--batch-size",
            type=_positive,
            default=purge.DEFAULT_BATCH_SIZE,
            metavar="ROWS",
            help="Rows per DELETE statement (default: %(default)s).",
        )
        parser.add_argument(
            "--pause-ratio",
            type=_ratio,
            default=purge.DEFAULT_PAUSE_RATIO,
            metavar="RATIO",
            help="After each batch, sleep RATIO times as long as the batch took, "
            "so the relay keeps its share of the database (default: %(default)s: "
            "the purge works at most half the time; 0: no pause).",
        )
        parser.add_argument(
            "--busy-pause-ratio",
            type=_ratio,
            default=purge.DEFAULT_BUSY_PAUSE_RATIO,
            metavar="RATIO",
            help="The same while relays have work waiting (due deliveries or "
            "events awaiting fan-out; looked at once a second): the purge yields "
            "to them (default: %(default)s: at most a fifth of the time).",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="Database alias (default: %(default)s).",
        )

    def handle(self, *args, **options):
        show = options["verbosity"] >= 1 and not options["dry_run"]
        bar = _Progress(self.stdout) if show else None
        try:
            counts = purge.purge(
                options["older_than"],
                batch_size=options["batch_size"],
                dry_run=options["dry_run"],
                pause_ratio=options["pause_ratio"],
                busy_pause_ratio=options["busy_pause_ratio"],
                progress=bar,
                using=options["database"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        if bar is not None:
            bar.finish()
        verb = "Would delete" if options["dry_run"] else "Deleted"
        summary = (
            f"{verb} {counts.events} event{pluralize(counts.events)}, "
            f"{counts.deliveries} deliver{pluralize(counts.deliveries, 'y,ies')}, "
            f"{counts.sentinels} sentinel row{pluralize(counts.sentinels)} and "
            f"{counts.inbox} inbox message{pluralize(counts.inbox)}."
        )
        if options["dry_run"]:
            self.stdout.write(summary + " (dry run: nothing deleted)")
        else:
            self.stdout.write(self.style.SUCCESS(summary))


class _Progress:
    """A progress bar on a terminal; elsewhere (cron, CI logs) one line at most
    every 5 seconds."""

    width = 30
    interval = 5.0

    def __init__(self, stdout):
        self.stdout = stdout
        self.tty = stdout.isatty()
        self.last = 0.0
        self.drawn = False

    def __call__(self, done: purge.PurgeCounts, expected: purge.PurgeCounts) -> None:
        total = max(expected.total, 1)
        fraction = min(done.total / total, 1.0)
        text = (
            f"{done.total}/{expected.total} rows ({fraction:.0%}): "
            f"{done.events} event{pluralize(done.events)}, "
            f"{done.deliveries} deliver{pluralize(done.deliveries, 'y,ies')}, "
            f"{done.sentinels} sentinel{pluralize(done.sentinels)}, "
            f"{done.inbox} inbox message{pluralize(done.inbox)}"
        )
        if self.tty:
            filled = int(self.width * fraction)
            bar = "#" * filled + "-" * (self.width - filled)
            self.stdout.write(f"\r[{bar}] {text}", ending="")
            self.stdout.flush()
            self.drawn = True
            return
        now = time.monotonic()
        if now - self.last >= self.interval or done.total >= expected.total:
            self.last = now
            self.stdout.write(f"purged {text}")

    def finish(self) -> None:
        if self.drawn:
            self.stdout.write("")
