"""The relay's own Prometheus metrics (optional: prometheus-client), emitted
as it delivers: outcomes, failures, handler and batch durations, pauses.
The metrics read from the database are :mod:`outbox_app.ops.metrics`'s."""

from __future__ import annotations

import datetime

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone


def _prometheus():
    try:
        import prometheus_client
        import prometheus_client.core
    except ImportError as exc:  # pragma: no cover - the extra is installed in CI
        raise ImproperlyConfigured(
            "Prometheus metrics need prometheus-client: "
            "pip install 'outbox_app[prometheus]'"
        ) from exc
    return prometheus_client


class RelayMetrics:
    """This relay process's own counters and histograms, served on
    ``manage.py relay --metrics-port`` (prometheus-client's HTTP server, with
    its process metrics). Every method is a no-op until :meth:`enable`: a
    relay without the option, or without prometheus-client, pays one
    attribute test per batch.

    =================================================  ==========================
    ``outbox_relay_outcomes_total{subscriber,outcome}``  rows by outcome:
                                                       succeeded, failed,
                                                       dead, lapsed,
                                                       released, lost
    ``outbox_relay_failures_total{subscriber,error}``  failed or dead
                                                       attempts by error class
    ``outbox_relay_handler_seconds{subscriber}``       histogram: one handler
                                                       call
    ``outbox_relay_batch_seconds{subscriber}``         histogram: delivering one
                                                       claimed batch
    ``outbox_relay_delivery_latency_seconds``          histogram: publish
    ``{subscriber}``                                   (``occurred_at``, or the
                                                       scheduled ``deliver_at``)
                                                       to a delivered batch's
                                                       outcome
    ``outbox_relay_publisher_paused{subscriber}``      1 while this relay has
                                                       the publisher paused
    =================================================  ==========================
    """

    enabled = False

    def enable(self, port: int, addr: str = "0.0.0.0") -> None:
        """Create the metrics and serve them on ``addr:port``.

        Raises:
            ImproperlyConfigured: prometheus-client is not installed.
            OSError: the port cannot be bound.
        """
        prometheus = _prometheus()
        registry = prometheus.REGISTRY
        self._outcomes = prometheus.Counter(
            "outbox_relay_outcomes",
            "Deliveries by outcome in this relay process (rows).",
            ["subscriber", "outcome"],
            registry=registry,
        )
        self._failures = prometheus.Counter(
            "outbox_relay_failures",
            "Failed or dead-lettered delivery attempts by error class.",
            ["subscriber", "error"],
            registry=registry,
        )
        self._batch = prometheus.Histogram(
            "outbox_relay_batch_seconds",
            "Seconds to deliver one claimed batch.",
            ["subscriber"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self._handler = prometheus.Histogram(
            "outbox_relay_handler_seconds",
            "Seconds one handler call took.",
            ["subscriber"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=registry,
        )
        self._latency = prometheus.Histogram(
            "outbox_relay_delivery_latency_seconds",
            "Seconds from an event's publish to its delivered batch's outcome.",
            ["subscriber"],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=registry,
        )
        self._paused = prometheus.Gauge(
            "outbox_relay_publisher_paused",
            "1 while this relay has the publisher paused by an outage.",
            ["subscriber"],
            registry=registry,
        )
        prometheus.start_http_server(port, addr=addr, registry=registry)
        self.enabled = True

    def outcome(self, subscriber: str, outcome: str, rows: int) -> None:
        if self.enabled and rows:
            self._outcomes.labels(subscriber, outcome).inc(rows)

    def failure(self, subscriber: str, error: str) -> None:
        if self.enabled:
            self._failures.labels(subscriber, error).inc()

    def handler(self, subscriber: str, seconds: float) -> None:
        if self.enabled:
            self._handler.labels(subscriber).observe(seconds)

    def batch(
        self,
        subscriber: str,
        seconds: float,
        published: list,
        now: datetime.datetime | None = None,
    ) -> None:
        """One delivered batch: its duration, and each row's latency from its
        event's ``occurred_at`` or ``deliver_at`` (aware datetimes) to ``now``
        (default ``timezone.now()``; the relay passes the database's clock)."""
        if not self.enabled:
            return
        self._batch.labels(subscriber).observe(seconds)
        if published:
            now = now or timezone.now()
            latency = self._latency.labels(subscriber)
            for occurred_at in published:
                latency.observe(max(0.0, (now - occurred_at).total_seconds()))

    def paused(self, subscriber: str, paused: bool) -> None:
        if self.enabled:
            self._paused.labels(subscriber).set(1 if paused else 0)


#: The relay process's metrics (:class:`RelayMetrics`).
relay_metrics = RelayMetrics()
