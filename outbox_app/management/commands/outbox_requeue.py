"""``manage.py outbox_requeue``: the admin's "Requeue" from a shell."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS

from outbox_app.exceptions import OutboxError
from outbox_app.management.base import OutboxCommand, moment
from outbox_app.ops import subscriptions
from outbox_app.store.lifecycle import REQUEUEABLE, State


class Command(OutboxCommand):
    help = (
        "Requeue a subscriber's failed and/or dead deliveries: they become "
        "PENDING and due now, with their attempts reset; the last error is kept "
        "as history until the next attempt. Works in batches, so any number of "
        "rows is fine. The same as the admin's 'Requeue' action."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--subscriber",
            required=True,
            metavar="NAME",
            help="The handler's or publisher's name (or a former name listed in "
            "its aliases), as the admin and outbox_status show it.",
        )
        parser.add_argument(
            "--state",
            choices=[str(s) for s in REQUEUEABLE],
            help="Only DEAD or only FAILED deliveries (default: both).",
        )
        parser.add_argument(
            "--error-type",
            metavar="PATH",
            help="Only deliveries whose last error has this exact dotted type, "
            "e.g. builtins.ConnectionError or kombu.exceptions.OperationalError.",
        )
        parser.add_argument(
            "--since",
            type=moment,
            metavar="DATE",
            help="Only deliveries that last failed (or changed) at or after "
            "DATE: 2025-01-31 or 2025-01-31T14:00 (current time zone) or with "
            "an offset, 2025-01-31T14:00+00:00.",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the deliveries that would be requeued; change nothing.",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="Database alias (default: %(default)s).",
        )

    def handle(self, *args, **options):
        states = [State(options["state"])] if options["state"] else REQUEUEABLE
        try:
            rows = subscriptions.deliveries_matching(
                subscriber=options["subscriber"],
                states=states,
                error_type=options["error_type"],
                since=options["since"],
                using=options["database"],
            )
            count = rows.apply("requeue", dry_run=options["dry_run"])
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        what = "/".join(str(s) for s in states)
        noun = "delivery" if count == 1 else "deliveries"
        if options["dry_run"]:
            self.stdout.write(
                f"Would requeue {count} {what} {noun} of {options['subscriber']} "
                "(dry run: nothing changed)."
            )
        else:
            self.stdout.write(
                self.style.SUCCESS(
                    f"Requeued {count} {what} {noun} of {options['subscriber']}."
                )
            )
