"""The outbox at a glance: what the admin overview page, its JSON endpoint and
``manage.py outbox_status`` show.

:func:`overview` answers the questions operators otherwise ask the database by
hand: how many deliveries wait, fail or are dead per subscriber, how
old the oldest waiting one is (the lag: from when it was due, so deliveries
scheduled for later are counted apart and never as lag), how many aggregates a
dead delivery
holds back, how many deliveries succeeded per minute, and how many events wait
for fan-out. It returns plain JSON types only.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, IntegerField, Min, QuerySet, Sum
from django.db.models.expressions import RawSQL
from django.db.models.functions import Coalesce, TruncMinute

from ..exceptions import renamed
from ..relay import registry
from ..store.clock import database_now
from ..store.lifecycle import UNFINISHED, InboxState, State
from ..store.models import (
    Delivery,
    InboxMessage,
    OutboxEvent,
    SubscriberPause,
    Subscription,
)
from ..store.sql import dialect
from ..subscribers import Subscriber
from . import streams

#: The states of the deliveries the lag measures: not finished and still
#: being tried (a DEAD one waits for an operator, not for a relay).
LAG_STATES = tuple(s for s in UNFINISHED if s != State.DEAD)
#: Length of the deliveries-per-minute series.
CHART_MINUTES = 24 * 60

_UTC = datetime.UTC


def overview(
    *,
    using: str = "default",
    now: datetime.datetime | None = None,
    deliveries: bool = True,
) -> dict[str, Any]:
    """Counts, lag and throughput of the outbox, per subscriber.

    Args:
        using: database alias.
        now: the clock (tests pass a fixed one); default the database's
            (:func:`~outbox_app.store.clock.database_now`).
        deliveries: count the deliveries per minute of the last 24 hours
            (``"deliveries"``: None without; a metrics scrape skips them).

    Returns:
        A JSON-serialisable dict::

            {
              "generated_at": "2025-01-01T12:00:00+00:00",
              "paused": [                     # publishers paused by an outage
                {"subscriber": "rabbitmq", "since": "...",
                 "paused_seconds": 42.0, "next_probe": "...", "probes": 3,
                 "reason": "cannot connect to amqp://...", "worker": "host:7"},
              ],
              "paused_by_operator": [         # outbox_subscribers --pause
                {"subscriber": "audit", "since": "...",
                 "paused_seconds": 600.0, "by": "admin: alice"},
              ],
              "unserved": [                   # subscriptions no running relay has
                {"subscriber": "audit", "event_type": "OrderPlaced",
                 "kind": "handler", "last_seen": "...",
                 "last_seen_seconds": 900.0, "last_seen_by": "host:7"},
              ],
              "lag_seconds": 12.5,            # oldest waiting delivery (since
                                              # it was due), event in a
                                              # stream or awaiting fan-out;
                                              # None when nothing waits
              "scheduled": 5,                 # PENDING, deliver_at still ahead
              "next_scheduled": "...",        # the soonest of those, or None
              "states": {"PENDING": 3, "RUNNING": 0, "SUCCEEDED": 90,
                         "FAILED": 1, "DEAD": 2},
              "dead": 2,
              "blocked_aggregates": 1,        # held back by a DEAD row,
                                              # ordered subscribers only
              "events_awaiting_fanout": 4,        # not fanned out yet
              "oldest_awaiting_fanout_seconds": 3.0,  # of a subscribed type
              "streams": [                    # stream delivery's cursors
                {"subscriber": "shop.handlers.email", "partition": 0,
                 "partitions": 1, "waiting": 12,
                 "oldest_waiting_seconds": 3.2, "held_by": "host:7",
                 "last_tick": "...", "last_tick_seconds": 0.4,
                 "stopping": False},          # see ops.streams.lag
              ],
              "subscribers": [
                {"name": "shop.handlers.email", "kind": "handler",
                 "registered": True, "ordered": False,
                 "stored_names": ["shop.handlers.email"],
                 "states": {...}, "total": 96, "dead": 2,
                 "oldest_pending_seconds": 12.5, "blocked_aggregates": None,
                 "scheduled": 5, "next_scheduled": "...",
                 "stream": {"waiting": 12,    # its cursors' sum (None: no
                            "oldest_waiting_seconds": 3.2,  # cursor)
                            "partitions": 1, "held_by": ["host:7"]},
                 "paused": None},             # or {"cause": "outage" |
                                              # "operator", "since",
                                              # "paused_seconds", "by",
                                              # "reason"}: its deliveries
                                              # wait, no attempt counted
                ...
              ],
              "deliveries": {"start": "...", "end": "...", "minutes": 1440,
                             "per_minute": [0, 4, ...], "total": 90,
                             "peak": 12},
              "inbox": [                      # manage.py consume's consumers
                {"consumer": "billing.invoice_order",
                 "states": {"HANDLED": 90, "FAILED": 1, "DEAD": 0}},
              ],
            }

        A subscriber row with ``"registered": False`` holds deliveries stored
        under a name no handler or publisher has any more (a removed or renamed
        subscriber without ``aliases``): nothing delivers them.

    Raises:
        ImproperlyConfigured: an ``OUTBOX_PUBLISHERS`` entry cannot be built.
    """
    now = now or database_now(using)
    subscribers = registry.subscribers()
    table = Delivery.objects.using(using)
    per_name = _PerName.read(table, now)
    rows = _subscriber_rows(subscribers, per_name, table, now)
    outages = paused(using=using, now=now)
    held = paused_by_operator(using=using, now=now)
    pauses = _pauses_by_subscriber(outages, held)
    for row in rows:
        row["paused"] = pauses.get(row["name"])
    states = per_name.total()
    awaiting = OutboxEvent.objects.using(using).awaiting_fanout()
    fanout_lag = _age(_oldest_awaiting_fanout(awaiting, subscribers), now)
    waiting = [row["oldest_pending_seconds"] for row in rows if row["registered"]]
    cursors = streams.lag(using, now)
    for row in rows:
        mine = [c for c in cursors if c["subscriber"] == row["name"]]
        row["stream"] = (
            {
                "waiting": sum(c["waiting"] for c in mine),
                "oldest_waiting_seconds": max(
                    (c["oldest_waiting_seconds"] or 0 for c in mine), default=0
                )
                or None,
                "partitions": len(mine),
                "held_by": sorted({c["held_by"] for c in mine if c["held_by"]}),
            }
            if mine
            else None
        )
    streamed = [c["oldest_waiting_seconds"] for c in cursors]
    lags = [lag for lag in [*waiting, *streamed, fanout_lag] if lag is not None]

    return {
        "generated_at": now.isoformat(),
        "paused": outages,
        "paused_by_operator": held,
        "unserved": unserved(using=using, now=now),
        "lag_seconds": max(lags) if lags else None,
        "states": states,
        "dead": states[State.DEAD],
        "scheduled": sum(row["scheduled"] for row in rows),
        "next_scheduled": min(
            (row["next_scheduled"] for row in rows if row["next_scheduled"]),
            key=datetime.datetime.fromisoformat,
            default=None,
        ),
        "blocked_aggregates": sum(row["blocked_aggregates"] or 0 for row in rows),
        "events_awaiting_fanout": awaiting.count(),
        "oldest_awaiting_fanout_seconds": fanout_lag,
        "streams": cursors,
        "subscribers": rows,
        "deliveries": (
            deliveries_per_minute(using=using, now=now) if deliveries else None
        ),
        "inbox": inbox(using=using),
    }


@dataclass
class _PerName:
    """What the deliveries say per stored subscriber name: rows by state,
    the oldest waiting one's due time, and the scheduled ones (their count
    and the soonest)."""

    states: dict[str, dict[str, int]]
    oldest: dict[str, datetime.datetime]
    scheduled: dict[str, tuple[int, datetime.datetime]]

    @classmethod
    def read(cls, table: QuerySet, now: datetime.datetime) -> _PerName:
        """Three grouped queries of ``table`` (the deliveries) at ``now``."""
        states: dict[str, dict[str, int]] = {}
        for name, state, n in (
            table.order_by()
            .values_list("subscriber", "state")
            .annotate(n=Count("id"))
            .values_list("subscriber", "state", "n")
        ):
            states.setdefault(name, {})[state] = n
        # A waiting row is late from when it was due: its scheduled
        # deliver_at, else its creation at fan-out. Rows scheduled for later
        # are not late.
        oldest = dict(
            table.filter(state__in=LAG_STATES)
            .exclude(deliver_at__gt=now)
            .order_by()
            .values_list("subscriber")
            .annotate(oldest=Min(Coalesce("deliver_at", "created_at")))
            .values_list("subscriber", "oldest")
        )
        scheduled = {
            name: (n, soonest)
            for name, n, soonest in table.scheduled(now)
            .order_by()
            .values_list("subscriber")
            .annotate(n=Count("id"), soonest=Min("deliver_at"))
            .values_list("subscriber", "n", "soonest")
        }
        return cls(states, oldest, scheduled)

    def total(self) -> dict[str, int]:
        """Rows by state, every subscriber's (every state present)."""
        total = {state.value: 0 for state in State}
        for counts in self.states.values():
            for state, n in counts.items():
                total[state] = total.get(state, 0) + n
        return total


def _subscriber_rows(
    subscribers: Sequence[Subscriber],
    per_name: _PerName,
    table: QuerySet,
    now: datetime.datetime,
) -> list[dict[str, Any]]:
    """One row per subscriber this process has, by name (its aliases' rows
    counted with its own), then one per name only stored rows carry (a
    subscriber removed or renamed without ``aliases``: ``registered``
    False)."""
    rows = []
    seen: set[str] = set()
    for subscriber in sorted(subscribers, key=lambda s: s.name):
        names = list(subscriber.stored_names)
        seen.update(names)
        blocked = (
            table.for_subscribers(names).blocked_aggregates()
            if subscriber.ordered
            else None
        )
        rows.append(
            _row(
                subscriber.name,
                names,
                per_name,
                now,
                kind=subscriber.kind,
                registered=True,
                ordered=subscriber.ordered,
                blocked=blocked,
            )
        )
    for name in sorted(set(per_name.states) - seen):
        rows.append(
            _row(
                name,
                [name],
                per_name,
                now,
                kind=None,
                registered=False,
                ordered=False,
                blocked=None,
            )
        )
    return rows


def _pauses_by_subscriber(
    outages: list[dict[str, Any]], held: list[dict[str, Any]]
) -> dict[str, dict[str, Any]]:
    """Subscriber name -> its pause as a subscriber row shows it: by an
    operator (:func:`paused_by_operator`) or by an outage of its destination
    (:func:`paused`), the outage shown when both: it is what the operator
    cannot undo."""
    pauses = {
        p["subscriber"]: {
            "cause": "operator",
            "since": p["since"],
            "paused_seconds": p["paused_seconds"],
            "by": p["by"],
            "reason": "",
        }
        for p in held
    }
    for p in outages:
        pauses[p["subscriber"]] = {
            "cause": "outage",
            "since": p["since"],
            "paused_seconds": p["paused_seconds"],
            "by": p["worker"],
            "reason": p["reason"],
        }
    return pauses


def inbox(*, using: str = "default") -> list[dict[str, Any]]:
    """The transactional inbox per consumer (``manage.py consume``): messages
    by state, one grouped query.

    Returns:
        ``[{"consumer", "states": {"HANDLED": n, "FAILED": n, "DEAD": n}},
        ...]`` by consumer name; empty when nothing was consumed.
    """
    by_consumer: dict[str, dict[str, int]] = {}
    for name, state, n in (
        InboxMessage.objects.using(using)
        .order_by()
        .values_list("consumer", "state")
        .annotate(n=Count("id"))
        .values_list("consumer", "state", "n")
    ):
        counts = by_consumer.setdefault(name, dict.fromkeys(InboxState.values, 0))
        counts[state] = n
    return [
        {"consumer": name, "states": states}
        for name, states in sorted(by_consumer.items())
    ]


def paused(
    *, using: str = "default", now: datetime.datetime | None = None
) -> list[dict[str, Any]]:
    """Publishers a relay has paused because their destination is unreachable
    (:class:`~outbox_app.store.models.SubscriberPause`), oldest outage first.

    Returns:
        ``[{"subscriber", "since", "paused_seconds", "next_probe", "probes",
        "reason", "worker"}, ...]``; empty when every destination answers.
    """
    now = now or database_now(using)
    return [
        {
            "subscriber": pause.subscriber,
            "since": pause.paused_at.isoformat(),
            "paused_seconds": _age(pause.paused_at, now),
            "next_probe": pause.resume_at.isoformat(),
            "probes": pause.probes,
            "reason": pause.reason,
            "worker": pause.worker,
        }
        for pause in SubscriberPause.objects.using(using)
        .paused(now)
        .order_by("paused_at")
    ]


def paused_by_operator(
    *, using: str = "default", now: datetime.datetime | None = None
) -> list[dict[str, Any]]:
    """Subscribers an operator paused (``Subscription.paused_at``): no relay
    claims their deliveries until they are resumed. Longest paused first.

    Returns:
        ``[{"subscriber", "since", "paused_seconds", "by"}, ...]``; empty
        when none is paused.
    """
    now = now or database_now(using)
    first: dict[str, tuple[datetime.datetime, str]] = {}
    for name, since, by in (
        Subscription.objects.using(using)
        .filter(paused_at__isnull=False)
        .order_by("paused_at")
        .values_list("subscriber", "paused_at", "paused_by")
    ):
        first.setdefault(name, (since, by))
    return [
        {
            "subscriber": name,
            "since": since.isoformat(),
            "paused_seconds": _age(since, now),
            "by": by,
        }
        for name, (since, by) in first.items()
    ]


def unserved(
    *, using: str = "default", now: datetime.datetime | None = None
) -> list[dict[str, Any]]:
    """Active subscriptions no running relay has (none refreshed them within
    ``SERVED_SECONDS``): fan-out still creates their deliveries, which
    wait for a relay that has the subscriber (or for ``outbox_subscribers
    --retire``).

    Returns:
        ``[{"subscriber", "event_type", "kind", "last_seen", "last_seen_seconds",
        "last_seen_by"}, ...]``, least recently seen first.
    """
    now = now or database_now(using)
    return [
        {
            "subscriber": s.subscriber,
            "event_type": s.event_type,
            "kind": s.kind,
            "last_seen": s.last_seen_at.isoformat(),
            "last_seen_seconds": _age(s.last_seen_at, now),
            "last_seen_by": s.last_seen_by,
        }
        for s in Subscription.objects.using(using)
        .unserved(now)
        .order_by("last_seen_at", "subscriber", "event_type")
    ]


def deliveries_per_minute(
    *, using: str = "default", now: datetime.datetime | None = None
) -> dict[str, Any]:
    """Successful deliveries per minute over the last 24 hours.

    Counted from ``completed_at`` of SUCCEEDED deliveries, and, for the
    events stream delivery delivered (no row, no time of delivery kept),
    from their ``created_at``; grouped by UTC minute in the database
    (``TruncMinute``: portable across PostgreSQL, MySQL/MariaDB and
    SQLite), so at most 1,440 rows come back however many
    deliveries there were. Rows already purged are not counted.

    Returns:
        ``{"start", "end", "minutes", "per_minute", "total", "peak"}``:
        ``per_minute[i]`` counts the minute starting ``start + i`` minutes; the
        last bucket is the current (partial) minute.
    """
    now = (now or database_now(using)).astimezone(_UTC)
    end = now.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    start = end - datetime.timedelta(minutes=CHART_MINUTES)
    per_minute = [0] * CHART_MINUTES
    buckets = (
        Delivery.objects.using(using)
        .filter(state=State.SUCCEEDED, completed_at__gte=start, completed_at__lt=end)
        .annotate(minute=TruncMinute("completed_at", tzinfo=_UTC))
        .order_by()
        .values_list("minute")
        .annotate(n=Count("id"))
        .values_list("minute", "n")
    )
    d = dialect(using)
    # Stream delivery keeps no row, nor time, of what it delivered: an
    # event read past counts in the minute it was published.
    streamed = (
        OutboxEvent.objects.using(using)
        .filter(
            fanned_out__isnull=True,
            event_type__isnull=False,
            created_at__gte=start,
            created_at__lt=end,
        )
        .annotate(
            minute=TruncMinute("created_at", tzinfo=_UTC),
            n=RawSQL(d.streamed_count(), [], output_field=IntegerField()),
        )
        .order_by()
        .values_list("minute")
        .annotate(total=Sum("n"))
        .values_list("minute", "total")
    )
    buckets = [*buckets, *streamed]
    for minute, n in buckets:
        index = int((minute.astimezone(_UTC) - start).total_seconds() // 60)
        if 0 <= index < CHART_MINUTES:
            per_minute[index] += n or 0
    return {
        "start": start.isoformat(),
        "end": end.isoformat(),
        "minutes": CHART_MINUTES,
        "per_minute": per_minute,
        "total": sum(per_minute),
        "peak": max(per_minute),
    }


def problems(
    data: dict[str, Any],
    *,
    max_lag: float | None = None,
    max_dead: int | None = None,
    max_dead_inbox: int | None = None,
) -> list[str]:
    """The thresholds an :func:`overview` crosses, as sentences for operators.

    Args:
        data: what :func:`overview` returned.
        max_lag: most seconds the oldest waiting delivery may be old.
        max_dead: most DEAD deliveries tolerated.
        max_dead_inbox: most DEAD inbox messages tolerated (the dead letter of
            ``manage.py consume``).

    Returns:
        One message per crossed threshold; empty when healthy.
    """
    found = []
    lag = data["lag_seconds"]
    if max_lag is not None and lag is not None and lag > max_lag:
        found.append(f"lag {lag:.1f}s is above --max-lag {max_lag:g}s")
    if max_dead is not None and data["dead"] > max_dead:
        noun = "delivery" if data["dead"] == 1 else "deliveries"
        found.append(f"{data['dead']} dead {noun}, more than --max-dead {max_dead}")
    dead_inbox = sum(row["states"][InboxState.DEAD] for row in data.get("inbox", ()))
    if max_dead_inbox is not None and dead_inbox > max_dead_inbox:
        found.append(
            f"{dead_inbox} dead inbox {'message' if dead_inbox == 1 else 'messages'}, "
            f"more than --max-dead-inbox {max_dead_inbox}"
        )
    return found


def _row(
    name: str,
    names: list[str],
    per_name: _PerName,
    now: datetime.datetime,
    *,
    kind: str | None,
    registered: bool,
    ordered: bool,
    blocked: int | None,
) -> dict[str, Any]:
    states = {state.value: 0 for state in State}
    for stored in names:
        for state, n in per_name.states.get(stored, {}).items():
            states[state] = states.get(state, 0) + n
    oldest = [per_name.oldest[n] for n in names if n in per_name.oldest]
    scheduled = [per_name.scheduled[n] for n in names if n in per_name.scheduled]
    return {
        "name": name,
        "kind": kind,
        "registered": registered,
        "ordered": ordered,
        "stored_names": names,
        "states": states,
        "total": sum(states.values()),
        "dead": states[State.DEAD],
        "oldest_pending_seconds": _age(min(oldest) if oldest else None, now),
        "blocked_aggregates": blocked,
        "scheduled": sum(n for n, _ in scheduled),
        "next_scheduled": _iso(min((t for _, t in scheduled), default=None)),
    }


def _oldest_awaiting_fanout(awaiting, subscribers: Sequence[Subscriber]):
    """Creation time of the oldest event waiting for fan-out that some subscriber
    receives (an event nobody subscribes to waits on purpose)."""
    if not subscribers:
        return None
    if all(s.event_types is not None for s in subscribers):
        types = set().union(*(s.event_types for s in subscribers))
        awaiting = awaiting.filter(event_type__in=types)
    return awaiting.aggregate(oldest=Min("created_at"))["oldest"]


def _iso(moment: datetime.datetime | None) -> str | None:
    return None if moment is None else moment.isoformat()


def _age(moment: datetime.datetime | None, now: datetime.datetime) -> float | None:
    if moment is None:
        return None
    return round(max(0.0, (now - moment).total_seconds()), 1)


__getattr__ = renamed(__name__, {"WAITING": "LAG_STATES"})
