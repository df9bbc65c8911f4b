"""``manage.py outbox_subscribers``: list, record, retire and reactivate the
subscriptions relays recorded (:class:`outbox_app.store.models.Subscription`) and
the consumers ``consume`` processes recorded
(:class:`outbox_app.store.models.ConsumerSubscription`)."""

from __future__ import annotations

from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, connections
from django.db.models import Count
from django.template.defaultfilters import pluralize

from outbox_app import inbox
from outbox_app.events.ids import worker_name
from outbox_app.exceptions import OutboxError
from outbox_app.management.base import OutboxCommand
from outbox_app.ops import streams, subscriptions
from outbox_app.relay import registry
from outbox_app.store.clock import database_now
from outbox_app.store.lifecycle import INBOX_REQUEUEABLE, UNFINISHED
from outbox_app.store.models import (
    ConsumerSubscription,
    Delivery,
    InboxMessage,
    SubscriberPause,
    Subscription,
)
from outbox_app.store.querysets import SERVED_SECONDS, SERVING_SECONDS, serving
from outbox_app.subscribers import WILDCARD
from outbox_app.templatetags.outbox_admin import duration


class Command(OutboxCommand):
    help = (
        "List the subscriptions relays recorded: one row per subscriber and event "
        "type, whether a relay serves it now (serving: refreshed within "
        f"{SERVING_SECONDS // 60} minutes; STALE: within {SERVED_SECONDS // 60} "
        "minutes, none serving now; UNSERVED: longer), when and by whom it was "
        "last served, whether it is paused (by an operator, or by an outage of "
        "its destination) and how many of its deliveries are unfinished; "
        "and the consumers consume processes recorded, with their "
        "failed and dead inbox messages. Fan-out creates deliveries for "
        "every active subscription, whichever relay runs it; a consume process "
        "keeps a message for every active consumer of its queue that it lacks. "
        "--record records this code's subscribers and consumers now (a deploy "
        "step, before processes of the new version start); --retire stops "
        "fan-out to a subscriber (or keeping messages for a consumer) that is "
        "gone from the code, saying what happens to what waits for it; "
        "--reactivate undoes it; --pause and --resume stop and restart the "
        "relays' claims for a subscriber without a restart."
    )

    def add_arguments(self, parser):
        action = parser.add_mutually_exclusive_group()
        action.add_argument(
            "--record",
            action="store_true",
            help="Record the handlers, publishers and consumers this project has "
            "(as a relay and consume do at start).",
        )
        action.add_argument(
            "--retire", metavar="NAME", help="Retire the subscriber or consumer NAME."
        )
        action.add_argument(
            "--reactivate",
            metavar="NAME",
            help="Reactivate the subscriber or consumer NAME.",
        )
        action.add_argument(
            "--pause",
            metavar="NAME",
            help="Pause the subscriber NAME: relays claim none of its deliveries "
            "(they wait, no attempt counted) until --resume; no restart needed.",
        )
        action.add_argument(
            "--resume", metavar="NAME", help="Resume the subscriber NAME."
        )
        parser.add_argument(
            "--event-type",
            metavar="TYPE",
            help="With --retire/--reactivate: only this event type's subscription "
            "(default: all of the subscriber's).",
        )
        parser.add_argument(
            "--waiting",
            choices=subscriptions.RETIRE_WAITING,
            help="Required with --retire: 'skip' gives up its PENDING, FAILED and "
            "DEAD deliveries (they become SKIPPED), or dead-letters a consumer's "
            "FAILED inbox messages; 'keep' leaves them for a process that has it.",
        )
        parser.add_argument(
            "--force",
            action="store_true",
            help="Retire even while a running relay (or consume) has it.",
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
        consumers = ConsumerSubscription.objects.using(using)
        name = options["retire"] or options["reactivate"]
        if (options["event_type"] or options["waiting"]) and not name:
            raise CommandError("--event-type and --waiting go with --retire")
        if name:
            rows = rows.filter(subscriber=name)
            consumers = consumers.filter(consumer=name)
            if options["event_type"]:
                rows = rows.filter(event_type=options["event_type"])
                consumers = consumers.filter(event_type=options["event_type"])
            if not rows.exists() and not consumers.exists():
                raise CommandError(f"no subscription of {name!r} is recorded")
        elif options["pause"] or options["resume"]:
            name = options["pause"] or options["resume"]
            rows = rows.filter(subscriber=name)
            if not rows.exists():
                raise CommandError(f"no subscription of {name!r} is recorded")
            if options["pause"]:
                count = subscriptions.pause(rows, by="manage.py outbox_subscribers")
                self.stdout.write(
                    f"Paused {name}: relays claim none of its deliveries until "
                    f"--resume {name}."
                    if count
                    else f"{name} was paused already."
                )
            else:
                count = subscriptions.resume(rows)
                self.stdout.write(
                    f"Resumed {name}." if count else f"{name} was not paused."
                )
            return
        if options["record"]:
            subscribers = registry.subscribers()
            rows.record(
                subscribers, f"outbox_subscribers {worker_name()}", started=True
            )
            found = inbox.consumers()
            consumers.record(found, f"outbox_subscribers {worker_name()}")
            n, m = len(subscribers), len(found)
            self.stdout.write(
                f"Recorded {n} subscriber{pluralize(n)} and {m} consumer{pluralize(m)}."
            )
        elif options["retire"]:
            if options["waiting"] is None:
                raise CommandError(
                    "--retire needs --waiting skip (give up its waiting "
                    "deliveries) or --waiting keep (leave them)"
                )
            how = {
                "waiting": options["waiting"],
                "by": "manage.py outbox_subscribers",
                "force": options["force"],
            }
            try:
                if rows.exists():
                    retired, skipped = subscriptions.retire(rows, **how)
                    self.stdout.write(
                        f"Retired {retired} subscriptions of {name}; "
                        f"{skipped} waiting deliveries skipped."
                    )
                if consumers.exists():
                    retired, dead = consumers.retire_and_settle(**how)
                    self.stdout.write(
                        f"Retired {retired} consumer subscriptions of {name}; "
                        f"{dead} waiting inbox messages dead-lettered."
                    )
            except OutboxError as exc:
                raise CommandError(str(exc)) from exc
            return
        elif options["reactivate"]:
            if rows.exists():
                count = subscriptions.reactivate(rows)
                self.stdout.write(f"Reactivated {count} subscriptions of {name}.")
            if consumers.exists():
                count = consumers.reactivate()
                self.stdout.write(
                    f"Reactivated {count} consumer subscriptions of {name}."
                )
            return
        self._table(using)

    def _table(self, using: str) -> None:
        now = database_now(using)
        subscriptions = list(
            Subscription.objects.using(using).order_by("subscriber", "event_type")
        )
        consumers = list(
            ConsumerSubscription.objects.using(using).order_by(
                "consumer", "queue", "event_type"
            )
        )
        if not subscriptions and not consumers:
            self.stdout.write(
                "No subscription is recorded yet (no relay nor consume has run)."
            )
            return
        unfinished = _counts(Delivery.objects.using(using), "subscriber", UNFINISHED)
        for key, n in streams.waiting(using).items():  # unread by its cursors
            unfinished[key] = unfinished.get(key, 0) + n
        failing = _counts(
            InboxMessage.objects.using(using), "consumer", INBOX_REQUEUEABLE
        )
        outages = {
            pause.subscriber: pause
            for pause in SubscriberPause.objects.using(using).paused(now)
        }
        columns = [
            "subscriber",
            "event type",
            "kind",
            "relay",
            "last served",
            "paused",
            "waiting",
        ]
        lines = []
        listed = [(s.subscriber, s.kind, s, unfinished) for s in subscriptions] + [
            (c.consumer, f"consumer on {c.queue}", c, failing) for c in consumers
        ]
        for name, kind, s, counts in listed:
            state = serving(s.retired_at, s.last_seen_at, now)
            if s.event_type == WILDCARD:
                waiting = sum(n for (key, _), n in counts.items() if key == name)
            else:
                waiting = counts.get((name, s.event_type), 0)
            age = duration((now - s.last_seen_at).total_seconds())
            lines.append(
                [
                    name,
                    s.event_type,
                    kind + (",ordered" if s.ordered else ""),
                    state if state in ("serving", "retired") else state.upper(),
                    f"{age} ago by {s.last_seen_by or '?'}",
                    _paused(s, outages.get(name), now),
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
            text = "  ".join(
                c.ljust(w) for c, w in zip(line, widths, strict=True)
            ).rstrip()
            quiet = line[3] in ("serving", "retired") and line[5] == "-"
            self.stdout.write(text if quiet else self.style.WARNING(text))


def _paused(row, outage, now) -> str:
    """The paused cell: "-", "<for how long> by <who>" (an operator) or
    "outage <for how long>" (a relay paused the publisher: its destination is
    unavailable)."""
    if outage is not None:
        return f"outage {duration((now - outage.paused_at).total_seconds())}"
    if getattr(row, "paused_at", None) is not None:
        since = duration((now - row.paused_at).total_seconds())
        return f"{since} by {row.paused_by or '?'}"
    return "-"


def _counts(rows, name: str, states) -> dict[tuple[str, str], int]:
    """(``name`` column, event type) -> rows in ``states``."""
    return {
        (row[name], row["event_type"]): row["n"]
        for row in rows.filter(state__in=states)
        .values(name, "event_type")
        .annotate(n=Count("id"))
        .order_by()
    }
