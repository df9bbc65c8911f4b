"""``manage.py outbox_replay``: the admin's "Replay to subscriber…" from a
shell (:func:`outbox_app.ops.subscriptions.replay_to`)."""

from __future__ import annotations

import uuid

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections

from outbox_app.exceptions import OutboxError
from outbox_app.management.base import OutboxCommand, moment
from outbox_app.ops import subscriptions
from outbox_app.relay import registry
from outbox_app.store.models import OutboxEvent


def _aggregate(text: str) -> tuple[str, str]:
    aggregate_type, colon, aggregate_id = text.partition(":")
    if not (aggregate_type and colon and aggregate_id):
        raise ValueError(text)
    return aggregate_type, aggregate_id


_aggregate.__name__ = "TYPE:ID"


class Command(OutboxCommand):
    help = (
        "Deliver committed events (again) to one subscriber, a handler or a "
        "publisher: its delivery of each selected event is created if it has "
        "none (a handler deployed after the events were published, a "
        "publisher added later), or put back to PENDING, due now, attempts "
        "reset, whatever its state (a consumer behind a publisher lost its "
        "data); a delivery running right now is left alone. Events of types "
        "the subscriber does not receive are skipped. Select the events with "
        "--event-type, --aggregate, --event, --since and --until (together: "
        "all of them must match), or --all. Works in batches, so any number "
        "of events is fine; relays deliver what it queued at their next turn. "
        "The same as the admin's 'Replay to subscriber…' action on the events "
        "list."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "subscriber",
            metavar="SUBSCRIBER",
            help="The handler's or publisher's name (or a former name listed in "
            "its aliases), as the admin and outbox_status show it.",
        )
        parser.add_argument(
            "--event-type",
            action="append",
            metavar="TYPE",
            help="Only events of this type (repeat for several).",
        )
        parser.add_argument(
            "--aggregate",
            type=_aggregate,
            metavar="TYPE:ID",
            help="Only the events of this aggregate, e.g. shop.Order:42.",
        )
        parser.add_argument(
            "--event",
            action="append",
            type=uuid.UUID,
            metavar="ID",
            help="Only this event, by its id (repeat for several).",
        )
        parser.add_argument(
            "--since",
            type=moment,
            metavar="DATE",
            help="Only events committed at or after DATE: 2025-01-31 or "
            "2025-01-31T14:00 (current time zone) or with an offset, "
            "2025-01-31T14:00+00:00.",
        )
        parser.add_argument(
            "--until",
            type=moment,
            metavar="DATE",
            help="Only events committed before DATE (same forms as --since).",
        )
        parser.add_argument(
            "--all",
            action="store_true",
            help="Every committed event the subscriber receives (needed when no "
            "other option selects: a whole history is never replayed by "
            "accident).",
        )
        parser.add_argument(
            "--dry-run",
            action="store_true",
            help="Count the selected events the subscriber receives; change nothing.",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            choices=list(connections),
            help="Database alias (default: %(default)s).",
        )

    def handle(self, *args, **options):
        name = options["subscriber"]
        events = self._selected(options)
        try:
            if options["dry_run"]:
                subscriber = registry.get(name)
                types = events.exclude(event_type=None).values_list(
                    "event_type", flat=True
                )
                received = [t for t in types.distinct() if subscriber.receives(t)]
                count = events.filter(event_type__in=received).count()
                self.stdout.write(
                    f"Would replay {count} event{'s'[: count != 1]} to {name} "
                    "(dry run: nothing changed)."
                )
                return
            result = subscriptions.replay_to(events, name)
        except OutboxError as exc:
            raise CommandError(str(exc)) from exc
        noun = "delivery is" if result.queued == 1 else "deliveries are"
        text = (
            f"Replayed to {name}: {result.queued} {noun} due now "
            f"({result.created} new, {result.reset} reset, {result.skipped} "
            "skipped: sentinels, types it does not receive, deliveries running "
            "now)."
        )
        self.stdout.write(self.style.SUCCESS(text) if result.queued else text)

    def _selected(self, options):
        events = OutboxEvent.objects.using(options["database"])
        selectors = {
            "event_type__in": options["event_type"],
            "id__in": options["event"],
            "created_at__gte": options["since"],
            "created_at__lt": options["until"],
        }
        if options["aggregate"]:
            selectors["aggregate_type"], selectors["aggregate_id"] = options[
                "aggregate"
            ]
        chosen = {key: value for key, value in selectors.items() if value}
        if not chosen and not options["all"]:
            raise CommandError(
                "select the events to replay (--event-type, --aggregate, --event, "
                "--since, --until), or pass --all for every event"
            )
        return events.filter(**chosen)
