"""Prometheus metrics of the outbox, read from the database at scrape time.

The optional extra ``outbox_app[prometheus]`` (prometheus-client). The numbers
are :func:`outbox_app.ops.status.overview`'s, so a scrape, ``outbox_status`` and
the admin's overview never disagree. Exposed three ways:

- :func:`metrics_view`, a Django view to route and protect as you like
  (docs/operations.md, "Metrics"): ``path("outbox/metrics", metrics_view)``;
  it wants ``Authorization: Bearer <OUTBOX_METRICS_TOKEN>``, and without
  the setting answers 403 unless ``DEBUG`` is True;
- ``python manage.py outbox_status --format prometheus``;
- :func:`exposition` for anything else (a node-exporter textfile, a test).

A relay process's own counters and histograms (deliveries, failures by error
class, durations, latency) are ``manage.py relay --metrics-port``'s, a
``consume`` process's (messages received, inbox messages by outcome,
failures, consumer durations, latency) ``manage.py consume
--metrics-port``'s (:mod:`outbox_app.execution.metrics`).

Metrics (gauges; ``subscriber`` is the handler's or publisher's name):

=========================================  ======================================
``outbox_deliveries{subscriber,state}``  deliveries per state (rows)
``outbox_lag_seconds{subscriber}``         age of the oldest waiting delivery
                                           (since it was due)
``outbox_scheduled_deliveries``         deliveries scheduled for later
``{subscriber}``                           (``deliver_at`` ahead; not lag)
``outbox_blocked_aggregates{subscriber}``  aggregates a DEAD row holds back
                                           (ordered subscribers only)
``outbox_events_awaiting_fanout``          events not fanned out yet (rows)
``outbox_fanout_lag_seconds``              age of the oldest of them
``outbox_stream_waiting_events``           events a cursor has still to read
``{subscriber,partition}``                 (stream delivery)
``outbox_stream_lag_seconds``              age of the oldest of them
``{subscriber,partition}``
``outbox_publisher_paused{subscriber}``    1 while a relay has it paused (outage)
``outbox_subscriber_paused_by_operator``  1 while an operator has it paused
``{subscriber}``
``outbox_subscription_unserved``           subscriptions no running relay has
``{subscriber,event_type}``
``outbox_inbox_messages{consumer,state}``  the inbox's messages (``consume``)
=========================================  ======================================
"""

from __future__ import annotations

import hmac
from collections.abc import Iterator
from typing import Any

from django.conf import settings
from django.http import HttpRequest, HttpResponse

from ..conf import outbox_settings
from ..execution.metrics import _prometheus
from ..store.lifecycle import State
from . import status


class OutboxCollector:
    """A prometheus-client collector reading the outbox of one database on
    each ``collect()`` (one scrape: a handful of grouped queries, no
    per-row work; the deliveries-per-minute chart is not computed).

    Args:
        using: database alias.
    """

    def __init__(self, using: str = "default") -> None:
        self.using = using

    def describe(self) -> list:
        return []  # collected at scrape time only

    def collect(self) -> Iterator[Any]:
        core = _prometheus().core
        data = status.overview(using=self.using, deliveries=False)
        deliveries = core.GaugeMetricFamily(
            "outbox_deliveries",
            "Deliveries per subscriber and state (rows).",
            labels=["subscriber", "state"],
        )
        lag = core.GaugeMetricFamily(
            "outbox_lag_seconds",
            "How long the subscriber's oldest waiting delivery has waited since "
            "it was due, in seconds.",
            labels=["subscriber"],
        )
        scheduled = core.GaugeMetricFamily(
            "outbox_scheduled_deliveries",
            "Deliveries scheduled for later (deliver_at ahead; rows), not lag.",
            labels=["subscriber"],
        )
        blocked = core.GaugeMetricFamily(
            "outbox_blocked_aggregates",
            "Aggregates a DEAD delivery holds back (ordered subscribers).",
            labels=["subscriber"],
        )
        for row in data["subscribers"]:
            for state in State.values:
                deliveries.add_metric(
                    [row["name"], state.lower()], row["states"][state]
                )
            if row["oldest_pending_seconds"] is not None:
                lag.add_metric([row["name"]], row["oldest_pending_seconds"])
            scheduled.add_metric([row["name"]], row["scheduled"])
            if row["blocked_aggregates"] is not None:
                blocked.add_metric([row["name"]], row["blocked_aggregates"])
        yield deliveries
        yield lag
        yield scheduled
        yield blocked
        yield core.GaugeMetricFamily(
            "outbox_events_awaiting_fanout",
            "Committed events not fanned out yet (rows).",
            value=data["events_awaiting_fanout"],
        )
        fanout_lag = core.GaugeMetricFamily(
            "outbox_fanout_lag_seconds",
            "Age of the oldest event of a subscribed type awaiting fan-out, "
            "in seconds.",
            labels=[],
        )
        if data["oldest_awaiting_fanout_seconds"] is not None:
            fanout_lag.add_metric([], data["oldest_awaiting_fanout_seconds"])
        yield fanout_lag
        stream_waiting = core.GaugeMetricFamily(
            "outbox_stream_waiting_events",
            "Events a subscriber's cursor has still to read (stream delivery).",
            labels=["subscriber", "partition"],
        )
        stream_lag = core.GaugeMetricFamily(
            "outbox_stream_lag_seconds",
            "Age of the oldest event a subscriber's cursor has still to read, "
            "in seconds (stream delivery).",
            labels=["subscriber", "partition"],
        )
        for cursor in data["streams"]:
            labels = [cursor["subscriber"], str(cursor["partition"])]
            stream_waiting.add_metric(labels, cursor["waiting"])
            if cursor["oldest_waiting_seconds"] is not None:
                stream_lag.add_metric(labels, cursor["oldest_waiting_seconds"])
        yield stream_waiting
        yield stream_lag
        paused = core.GaugeMetricFamily(
            "outbox_publisher_paused",
            "1 while a relay has the publisher paused by an outage of its destination.",
            labels=["subscriber"],
        )
        for pause in data["paused"]:
            paused.add_metric([pause["subscriber"]], 1)
        yield paused
        held = core.GaugeMetricFamily(
            "outbox_subscriber_paused_by_operator",
            "1 while an operator has the subscriber paused (admin action or "
            "outbox_subscribers --pause): its deliveries wait.",
            labels=["subscriber"],
        )
        for pause in data["paused_by_operator"]:
            held.add_metric([pause["subscriber"]], 1)
        yield held
        unserved = core.GaugeMetricFamily(
            "outbox_subscription_unserved",
            "1 for a subscription no running relay has refreshed lately.",
            labels=["subscriber", "event_type"],
        )
        for row in data["unserved"]:
            unserved.add_metric([row["subscriber"], row["event_type"]], 1)
        yield unserved
        inbox = core.GaugeMetricFamily(
            "outbox_inbox_messages",
            "Messages manage.py consume received, per consumer and state (rows).",
            labels=["consumer", "state"],
        )
        for row in data["inbox"]:
            for state, n in row["states"].items():
                inbox.add_metric([row["consumer"], state.lower()], n)
        yield inbox


def exposition(using: str = "default") -> tuple[bytes, str]:
    """The outbox's metrics in Prometheus' text format.

    Returns:
        ``(body, content type)``.

    Raises:
        ImproperlyConfigured: prometheus-client is not installed.
        django.db.DatabaseError: the database cannot be read.
    """
    prometheus = _prometheus()
    registry = prometheus.CollectorRegistry(auto_describe=False)
    registry.register(OutboxCollector(using))
    return prometheus.generate_latest(registry), prometheus.CONTENT_TYPE_LATEST


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The outbox's metrics for a Prometheus scrape (GET).

    With ``OUTBOX_METRICS_TOKEN`` set, a request without ``Authorization:
    Bearer <that token>`` gets 403 (compared in constant time). Without it the
    view is closed: 403 to every request, saying to set the token, unless
    ``settings.DEBUG`` is True (a developer's machine). Route it, and restrict
    it further if you like (a network policy, a login decorator).
    """
    token = outbox_settings.METRICS_TOKEN
    if token:
        sent = request.headers.get("Authorization", "")
        if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
            return HttpResponse("forbidden\n", status=403, content_type="text/plain")
    elif not settings.DEBUG:
        return HttpResponse(
            "forbidden: set OUTBOX_METRICS_TOKEN to serve the outbox's metrics "
            "(scrape with Authorization: Bearer <token>); without it they are "
            "served only when DEBUG is True\n",
            status=403,
            content_type="text/plain",
        )
    body, content_type = exposition()
    return HttpResponse(body, content_type=content_type)
