"""``manage.py outbox_subscribers``: list, record, retire and reactivate the
subscriptions relays recorded (:class:`outbox_app.models.Subscription`)."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Count
from django.template.defaultfilters import pluralize

from outbox_app import operations, registry
from outbox_app.db import database_now
from outbox_app.exceptions import OutboxError
from outbox_app.ids import worker_name
from outbox_app.models import Notification, Subscription
from outbox_app.querysets import SERVED_SECONDS
from outbox_app.states import UNFINISHED
from outbox_app.subscribers import WILDCARD


class Command(BaseCommand):
    help = (
        "List the subscriptions relays recorded: one row per subscriber and event "
        "type, whether a running relay serves it (refreshed within "
        f"{SERVED_SECONDS // 60} minutes) and how many of its notifications are "
        "unfinished. Fan-out creates notifications for every active subscription, "
        "whichever relay runs it. --record records this code's subscribers now "
        "(a deploy step, before relays of the new version start); --retire stops "
        "fan-out to a subscriber that is gone from the code, saying what happens "
        "to its waiting notifications; --reactivate undoes it."
    )

    def add_arguments(self, parser):
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--record",
            action="store_true",
            help="Record the handlers and publishers this project has (as a relay "
            "does at start).",
        )
        action.add_argument(
            "--retire", metavar="NAME", help="Retire the subscriber NAME."
        )
        action.add_argument(
            "--reactivate", metavar="NAME", help="Reactivate the subscriber NAME."
        )
        parser.add_argument(
            "--event-type",
            metavar="TYPE",
            help="With --retire/--reactivate: only this event type's subscription "
            "(default: all of the subscriber's).",
        )
        parser.add_argument(
            "--waiting",
            choices=operations.WAITING,
            help="Required with --retire: 'skip' gives up its PENDING, FAILED and "
            "EXPIRED notifications (they become SKIPPED); 'keep' leaves them for a "
            "relay that has the subscriber.",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="Retire even while a running relay has the subscriber.",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            choices=list(connections),
            help="Database alias (default: %(default)s).",
        )

    def handle(self, *args, **options):
        using = options["database"]
        rows = Subscription.objects.using(using)
        name = options["retire"] or options["reactivate"]
        if name:
            rows = rows.filter(subscriber=name)
            if options["event_type"]:
                rows = rows.filter(event_type=options["event_type"])
            if not rows.exists():
                raise CommandError(f"no subscription of {name!r} is recorded")
        elif options["event_type"] or options["waiting"]:
            raise CommandError("--event-type and --waiting go with --retire")
        if options["record"]:
            subscribers = registry.subscribers()
            rows.record(subscribers, f"outbox_subscribers {worker_name()}")
            n = len(subscribers)
            self.stdout.write(f"Recorded {n} subscriber{pluralize(n)}.")
        elif options["retire"]:
            if options["waiting"] is None:
                raise CommandError(
                    "--retire needs --waiting skip (give up its waiting "
                    "notifications) or --waiting keep (leave them)"
                )
            try:
                retired, skipped = operations.retire(
                    rows,
                    waiting=options["waiting"],
                    by="manage.py outbox_subscribers",
                    force=options["force"],
                )
            except OutboxError as exc:
                raise CommandError(str(exc)) from exc
            self.stdout.write(
                f"Retired {retired} subscriptions of {name}; "
                f"{skipped} waiting notifications skipped."
            )
            return
        elif options["reactivate"]:
            count = operations.reactivate(rows)
            self.stdout.write(f"Reactivated {count} subscriptions of {name}.")
            return
        self._table(using)

    def _table(self, using: str) -> None:
        now = database_now(using)
        subscriptions = list(
            Subscription.objects.using(using).order_by("subscriber", "event_type")
        )
        if not subscriptions:
            self.stdout.write("No subscription is recorded yet (no relay has run).")
            return
        unfinished = {
            (row["subscriber"], row["event_type"]): row["n"]
            for row in Notification.objects.using(using)
            .filter(state__in=UNFINISHED)
            .values("subscriber", "event_type")
            .annotate(n=Count("id"))
            .order_by()
        }
        columns = ["subscriber", "event type", "kind", "state", "last seen", "waiting"]
        lines = []
        for s in subscriptions:
            pair = (s.subscriber, s.event_type)
            if s.retired_at is not None:
                state = "retired"
            else:
                state = "served" if s.is_served(now) else "UNSERVED"
            if s.event_type == WILDCARD:
                waiting = sum(
                    n for (name, _), n in unfinished.items() if name == s.subscriber
                )
            else:
                waiting = unfinished.get(pair, 0)
            age = int((now - s.last_seen_at).total_seconds())
            lines.append(
                [
                    s.subscriber,
                    s.event_type,
                    s.kind + (",ordered" if s.ordered else ""),
                    state,
                    f"{age}s ago by {s.last_seen_by or '?'}",
                    str(waiting),
                ]
            )
        widths = [
            max(len(c), *(len(r[i]) for r in lines)) for i, c in enumerate(columns)
        ]
        self.stdout.write(
            self.style.MIGRATE_HEADING(
                "  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True))
            )
        )
        for line in lines:
            text = "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))
            self.stdout.write(self.style.WARNING(text) if "UNSERVED" in line else text)
