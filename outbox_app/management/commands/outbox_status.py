"""``manage.py outbox_status``: the outbox overview in a terminal, and a health
check: the exit status is non-zero when a threshold is crossed."""

from __future__ import annotations

import json

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import CommandError
from django.db import DEFAULT_DB_ALIAS, DatabaseError
from django.template.defaultfilters import pluralize

from outbox_app.conf import mask_url
from outbox_app.exceptions import OutboxError
from outbox_app.management.base import OutboxCommand
from outbox_app.ops import metrics, status
from outbox_app.store.lifecycle import State

#: Exit status when a --max-* threshold is crossed (1 is any other failure).
UNHEALTHY = 2


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise ValueError(text)
        return value

    parse.__name__ = kind.__name__
    return parse


class Command(OutboxCommand):
    help = (
        "Show the outbox: per subscriber, deliveries by state, deliveries "
        "scheduled for later (publish(deliver_at=...)), the lag (how long the "
        "oldest delivery has waited since it was due), dead deliveries, "
        "aggregates an "
        "dead delivery blocks, whether it is paused (its destination "
        "unavailable: outage; or by an operator), events waiting for fan-out, "
        "deliveries in the last 24 hours and the inbox's messages per "
        "consumer. With --max-lag / "
        "--max-dead / --max-dead-inbox it is a health check: the "
        f"exit status is {UNHEALTHY} when a threshold is crossed, 1 when the "
        "outbox cannot be read, 0 otherwise."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--format",
            choices=["table", "json", "prometheus"],
            default="table",
            help="table (default); json: one JSON object, the admin's "
            "overview.json plus a 'problems' list; prometheus: the metrics in "
            "Prometheus' text format (outbox_app.ops.metrics; needs "
            "outbox_app[prometheus]), e.g. for node-exporter's textfile "
            "collector.",
        )
        parser.add_argument(
            "--json",
            action="store_const",
            const="json",
            dest="format",
            help="The same as --format json.",
        )
        parser.add_argument(
            "--max-lag",
            type=_non_negative(float),
            metavar="SECONDS",
            help="Unhealthy when the oldest waiting delivery (or event waiting "
            "for fan-out) is older than this many seconds.",
        )
        parser.add_argument(
            "--max-dead",
            "--max-expired",  # its name before DEAD was the one dead letter
            dest="max_dead",
            type=_non_negative(int),
            metavar="N",
            help="Unhealthy when more than N deliveries are DEAD.",
        )
        parser.add_argument(
            "--max-dead-inbox",
            "--max-parked",  # its name before DEAD was the one dead letter
            dest="max_dead_inbox",
            type=_non_negative(int),
            metavar="N",
            help="Unhealthy when more than N inbox messages are DEAD (the "
            "dead letter of manage.py consume).",
        )
        parser.add_argument(
            "--database",
            default=DEFAULT_DB_ALIAS,
            help="Database alias to read (default: %(default)s).",
        )

    def handle(self, *args, **options):
        using = options["database"]
        try:
            if options["format"] == "prometheus":
                body, _ = metrics.exposition(using)
                self.stdout.write(body.decode(), ending="")
                return
            data = status.overview(using=using)
        except (OutboxError, ImproperlyConfigured, DatabaseError) as exc:
            raise CommandError(f"cannot read the outbox: {mask_url(str(exc))}") from exc
        problems = status.problems(
            data,
            max_lag=options["max_lag"],
            max_dead=options["max_dead"],
            max_dead_inbox=options["max_dead_inbox"],
        )
        if options["format"] == "json":
            self.stdout.write(json.dumps({**data, "problems": problems}, indent=2))
        else:
            self._table(data, problems)
        if problems:
            raise CommandError("; ".join(problems), returncode=UNHEALTHY)

    def _table(self, data, problems) -> None:
        write = self.stdout.write
        columns = ["subscriber", "kind", *(s.lower() for s in State.values)]
        columns += ["scheduled", "lag", "blocked", "paused"]
        rows = []
        for row in data["subscribers"]:
            kind = row["kind"] or "unregistered"
            if row["ordered"]:
                kind += ",ordered"
            blocked = row["blocked_aggregates"]
            rows.append(
                [
                    row["name"],
                    kind,
                    *(str(row["states"][s]) for s in State.values),
                    str(row["scheduled"]),
                    _seconds(row["oldest_pending_seconds"]),
                    "-" if blocked is None else str(blocked),
                    _paused(row["paused"]),
                ]
            )
        if rows:
            widths = [
                max(len(columns[i]), *(len(r[i]) for r in rows))
                for i in range(len(columns))
            ]
            line = "  ".join(
                c.ljust(w) if i < 2 else c.rjust(w)
                for i, (c, w) in enumerate(zip(columns, widths, strict=True))
            )
            write(self.style.MIGRATE_HEADING(line))
            for r in rows:
                write(
                    "  ".join(
                        c.ljust(w) if i < 2 else c.rjust(w)
                        for i, (c, w) in enumerate(zip(r, widths, strict=True))
                    )
                )
        else:
            write("No handler or publisher is configured and no delivery exists.")
        write("")
        write(f"lag:                 {_seconds(data['lag_seconds'])}")
        scheduled = data["scheduled"]
        soonest = data["next_scheduled"]
        write(
            f"scheduled:           {scheduled} "
            f"(pending, not due yet{'; next at ' + soonest if soonest else ''})"
        )
        write(f"dead:                {data['dead']}")
        write(f"blocked aggregates:  {data['blocked_aggregates']}")
        awaiting = data["events_awaiting_fanout"]
        oldest = data["oldest_awaiting_fanout_seconds"]
        suffix = "" if oldest is None else f" (oldest subscribed: {_seconds(oldest)})"
        write(f"awaiting fan-out:    {awaiting} event{pluralize(awaiting)}{suffix}")
        for cursor in data["streams"]:
            part = (
                ""
                if cursor["partitions"] == 1
                else f" [{cursor['partition'] + 1}/{cursor['partitions']}]"
            )
            oldest = cursor["oldest_waiting_seconds"]
            tick = cursor["last_tick_seconds"]
            write(
                f"stream {cursor['subscriber']}{part}: {cursor['waiting']} "
                f"waiting{'' if oldest is None else ', oldest ' + _seconds(oldest)}; "
                f"{'held by ' + cursor['held_by'] if cursor['held_by'] else 'no relay'}"
                f"{'' if tick is None else '; last tick ' + _seconds(tick) + ' ago'}"
                f"{'; stopping (its partitions change)' if cursor['stopping'] else ''}"
            )
        deliveries = data["deliveries"]
        write(
            f"delivered in 24 h:   {deliveries['total']} "
            f"(peak {deliveries['peak']}/min)"
        )
        for row in data["inbox"]:
            states = row["states"]
            write(
                f"inbox {row['consumer']}: "
                + ", ".join(f"{n} {state.lower()}" for state, n in states.items())
            )
        for pause in data["paused"]:
            write(
                self.style.WARNING(
                    f"PAUSED: {pause['subscriber']} for "
                    f"{_seconds(pause['paused_seconds'])}, destination unavailable "
                    f"(no attempts counted; next probe {pause['next_probe']}, "
                    f"{pause['probes']} failed): {pause['reason']}"
                )
            )
        for pause in data["paused_by_operator"]:
            write(
                self.style.WARNING(
                    f"PAUSED: {pause['subscriber']} for "
                    f"{_seconds(pause['paused_seconds'])}, by an operator "
                    f"({pause['by'] or '?'}): no relay claims its deliveries "
                    "until it is resumed (manage.py outbox_subscribers --resume "
                    f"{pause['subscriber']})"
                )
            )
        for row in data["unserved"]:
            write(
                self.style.WARNING(
                    f"UNSERVED: {row['subscriber']} <- {row['event_type']} "
                    f"({row['kind']}): no running relay has it, last seen "
                    f"{_seconds(row['last_seen_seconds'])} ago by "
                    f"{row['last_seen_by'] or '?'}; its deliveries wait "
                    "(manage.py outbox_subscribers)"
                )
            )
        for problem in problems:
            write(self.style.ERROR(f"UNHEALTHY: {problem}"))


def _paused(pause: dict | None) -> str:
    """A subscriber row's paused cell: "-", "outage" or "operator"."""
    return "-" if pause is None else pause["cause"]


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}s"
