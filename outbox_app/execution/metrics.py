"""The Prometheus metrics a process running user code emits as it runs it
(optional: prometheus-client): the relay's (outcomes, failures, handler and
batch durations, pauses) and ``consume``'s (outcomes, failures, consumer
durations). The metrics read from the database are
:mod:`outbox_app.ops.metrics`'s."""

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


class CallMetrics:
    """One process's counters of the user code it runs, one kind of it
    (handlers in ``relay``, consumers in ``consume``). Every method is a no-op
    until :meth:`enable`: a process without ``--metrics-port``, or without
    prometheus-client, pays one attribute test per call.

    ==============================================  ============================
    ``outbox_<process>_outcomes_total{<label>,``    rows by outcome (the words
    ``outcome}``                                    are the process's own)
    ``outbox_<process>_failures_total{<label>,``    failed or dead attempts by
    ``error}``                                      error class
    ``outbox_<process>_<callee>_seconds{<label>}``  histogram: one call of the
                                                    user code
    ==============================================  ============================

    Args:
        process: the command that runs the code (``"relay"``, ``"consume"``).
        label: the label naming whose row or call it is (``"subscriber"``,
            ``"consumer"``).
        callee: what the user code is (``"handler"``, ``"consumer"``).
        rows: what the outcomes count, capitalized (``"Deliveries"``,
            ``"Inbox messages"``).
    """

    enabled = False

    def __init__(self, process: str, label: str, callee: str, rows: str):
        self.process, self.label, self.callee, self.rows = process, label, callee, rows

    def enable(self, port: int | None, addr: str = "127.0.0.1", registry=None) -> None:
        """Create the metrics and serve them on ``addr:port``.

        Args:
            port: where to serve them (prometheus-client's HTTP server, with
                its process metrics); None: only create them (a caller that
                reads ``registry`` itself).
            addr: the address to bind: loopback by default (the server checks
                no credentials); ``"0.0.0.0"`` or ``"::"`` for every
                interface.
            registry: where to create them; default prometheus-client's
                global one.

        Raises:
            ImproperlyConfigured: prometheus-client is not installed.
            OSError: the port cannot be bound.
        """
        prometheus = _prometheus()
        registry = registry or prometheus.REGISTRY
        self._create(prometheus, registry)
        if port is not None:
            prometheus.start_http_server(port, addr=addr, registry=registry)
        self.enabled = True

    def _create(self, prometheus, registry) -> None:
        prefix, label = f"outbox_{self.process}", self.label
        self._outcomes = prometheus.Counter(
            f"{prefix}_outcomes",
            f"{self.rows} by outcome in this {self.process} process (rows).",
            [label, "outcome"],
            registry=registry,
        )
        self._failures = prometheus.Counter(
            f"{prefix}_failures",
            "Failed or dead-lettered attempts by error class.",
            [label, "error"],
            registry=registry,
        )
        self._calls = prometheus.Histogram(
            f"{prefix}_{self.callee}_seconds",
            f"Seconds one {self.callee} call took.",
            [label],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 5),
            registry=registry,
        )

    def outcome(self, name: str, outcome: str, rows: int = 1) -> None:
        if self.enabled and rows:
            self._outcomes.labels(name, outcome).inc(rows)

    def failure(self, name: str, error: str) -> None:
        if self.enabled:
            self._failures.labels(name, error).inc()

    def call(self, name: str, seconds: float) -> None:
        if self.enabled:
            self._calls.labels(name).observe(seconds)


class RelayMetrics(CallMetrics):
    """The relay process's own counters and histograms, served on
    ``manage.py relay --metrics-port``: :class:`CallMetrics`' for handlers and
    publishers, and the relay's own.

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

    def __init__(self):
        super().__init__("relay", "subscriber", "handler", "Deliveries")

    def _create(self, prometheus, registry) -> None:
        super()._create(prometheus, registry)
        self._batch = prometheus.Histogram(
            "outbox_relay_batch_seconds",
            "Seconds to deliver one claimed batch.",
            ["subscriber"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
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

#: The ``consume`` process's metrics, served on ``manage.py consume
#: --metrics-port`` (:class:`CallMetrics`):
#: ``outbox_consume_outcomes_total{consumer,outcome}`` (messages by what their
#: inbox row became: handled, failed, dead),
#: ``outbox_consume_failures_total{consumer,error}`` and the histogram
#: ``outbox_consume_consumer_seconds{consumer}`` (one consumer call).
consume_metrics = CallMetrics("consume", "consumer", "consumer", "Inbox messages")
