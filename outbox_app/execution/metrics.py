"""What a process running user code counts as it runs it: the counts of one
pass (:class:`Counts`: the relay's ``RelayReport``, the inbox's ``Tally``),
and the Prometheus metrics (optional: prometheus-client): the relay's
(outcomes, failures, handler and batch durations, delivery latency, pauses)
and ``consume``'s (messages received, outcomes, failures, consumer
durations, latency). The metrics read from the database are
:mod:`outbox_app.ops.metrics`'s."""

from __future__ import annotations

import collections
import dataclasses
import datetime
from collections.abc import Iterable
from typing import Self

from django.core.exceptions import ImproperlyConfigured


@dataclasses.dataclass
class Counts:
    """Counts of one pass of a process (a relay's turn, a ``consume``
    batch), one int field per outcome; a subclass declares the fields
    (``RelayReport``: rows; ``Tally``: messages per consumer). They add up
    (``+=``) and read as a dict, a log line's fields and a sentence."""

    def __iadd__(self, other: Self) -> Self:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def as_dict(self) -> dict[str, int]:
        """``{outcome: count}`` in the fields' order."""
        return dataclasses.asdict(self)

    def fields(self) -> str:
        """``succeeded=1 failed=0 ...``: the counts as a log line's fields."""
        return " ".join(f"{name}={n}" for name, n in self.as_dict().items())

    def __str__(self) -> str:
        return ", ".join(f"{name} {n}" for name, n in self.as_dict().items())


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
    ``outbox_<process>_<latency>{<label>}``         histogram: an event's
                                                    publish to its row's
                                                    success
    ==============================================  ============================

    Args:
        process: the command that runs the code (``"relay"``, ``"consume"``).
        label: the label naming whose row or call it is (``"subscriber"``,
            ``"consumer"``).
        callee: what the user code is (``"handler"``, ``"consumer"``).
        rows: what the outcomes count, capitalized (``"Deliveries"``,
            ``"Inbox messages"``).
        latency: the latency histogram's name after the prefix
            (``"delivery_latency_seconds"``) and what ends it, for its help
            (``"its delivery's SUCCEEDED mark"``).
    """

    enabled = False

    def __init__(
        self, process: str, label: str, callee: str, rows: str, latency: tuple[str, str]
    ):
        self.process, self.label, self.callee, self.rows = process, label, callee, rows
        self.latency_name, self.latency_end = latency

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
        self._latency = prometheus.Histogram(
            f"{prefix}_{self.latency_name}",
            f"Seconds from an event's publish to {self.latency_end}.",
            [label],
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
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

    def latency(
        self,
        name: str,
        since: Iterable[datetime.datetime | None],
        now: datetime.datetime | None,
    ) -> None:
        """Rows of ``name`` that succeeded at ``now``: each one's latency
        from ``since``, its event's publish (aware datetimes; a None is left
        out, as is every row when ``now`` is None)."""
        if self.enabled and now is not None:
            latency = self._latency.labels(name)
            for moment in since:
                if moment is not None:
                    latency.observe(max(0.0, (now - moment).total_seconds()))


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
                                                       to the SUCCEEDED mark of
                                                       a delivered row (no
                                                       other outcome counts)
    ``outbox_relay_publisher_paused{subscriber}``      1 while this relay has
                                                       the publisher paused
    =================================================  ==========================
    """

    def __init__(self):
        super().__init__(
            "relay",
            "subscriber",
            "handler",
            "Deliveries",
            ("delivery_latency_seconds", "its delivery's SUCCEEDED mark"),
        )

    def _create(self, prometheus, registry) -> None:
        super()._create(prometheus, registry)
        self._batch = prometheus.Histogram(
            "outbox_relay_batch_seconds",
            "Seconds to deliver one claimed batch.",
            ["subscriber"],
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=registry,
        )
        self._paused = prometheus.Gauge(
            "outbox_relay_publisher_paused",
            "1 while this relay has the publisher paused by an outage.",
            ["subscriber"],
            registry=registry,
        )

    def batch(self, subscriber: str, seconds: float) -> None:
        """One claimed batch delivered in ``seconds``."""
        if self.enabled:
            self._batch.labels(subscriber).observe(seconds)

    def paused(self, subscriber: str, paused: bool) -> None:
        if self.enabled:
            self._paused.labels(subscriber).set(1 if paused else 0)


#: The relay process's metrics (:class:`RelayMetrics`).
relay_metrics = RelayMetrics()


class ConsumeMetrics(CallMetrics):
    """The ``consume`` process's own counters and histograms, served on
    ``manage.py consume --metrics-port``: :class:`CallMetrics`' for
    consumers, and what the inbox alone knows.

    =================================================  ==========================
    ``outbox_consume_received_total{queue}``           messages taken from the
                                                       broker (a redelivery
                                                       counts again)
    ``outbox_consume_outcomes_total{consumer,``        messages by what happened
    ``outcome}``                                       for the consumer:
                                                       handled, failed, dead,
                                                       duplicate, waiting,
                                                       expired, deferred
    ``outbox_consume_failures_total{consumer,error}``  failed or dead attempts
                                                       by error class
    ``outbox_consume_consumer_seconds{consumer}``      histogram: one consumer
                                                       call
    ``outbox_consume_latency_seconds{consumer}``       histogram: publish (the
                                                       CloudEvent's ``time``,
                                                       or its ``deliverat``) to
                                                       the commit of a handled
                                                       message (no other
                                                       outcome counts)
    ``outbox_consume_differing_duplicates_total``      duplicates whose body
    ``{consumer}``                                     differs from the first
                                                       message's of their id
                                                       (counted as
                                                       ``duplicate`` too)
    =================================================  ==========================
    """

    def __init__(self):
        super().__init__(
            "consume",
            "consumer",
            "consumer",
            "Inbox messages",
            ("latency_seconds", "the commit of its handled message"),
        )

    def _create(self, prometheus, registry) -> None:
        super()._create(prometheus, registry)
        self._received = prometheus.Counter(
            "outbox_consume_received",
            "Messages this consume process took from the broker, by queue "
            "(a redelivery counts again).",
            ["queue"],
            registry=registry,
        )
        self._differing = prometheus.Counter(
            "outbox_consume_differing_duplicates",
            "Duplicates whose body differs from the first message's of their "
            "id: acknowledged without running, the first one kept (messages).",
            ["consumer"],
            registry=registry,
        )

    def received(self, queues: Iterable[str]) -> None:
        """Messages taken from the broker: the queue of each."""
        if self.enabled:
            for queue, messages in collections.Counter(queues).items():
                self._received.labels(queue).inc(messages)

    def differing(self, consumer: str) -> None:
        """A duplicate for ``consumer`` whose body differs from the first."""
        if self.enabled:
            self._differing.labels(consumer).inc()

    def handled(
        self,
        consumer: str,
        since: datetime.datetime | None,
        now: datetime.datetime | None,
    ) -> None:
        """A message handled for ``consumer``, committed at ``now``: counted,
        and its latency observed from ``since`` (its event's publish, an
        aware datetime; None: the message has no ``time``)."""
        self.outcome(consumer, "handled")
        self.latency(consumer, (since,), now)


#: The ``consume`` process's metrics (:class:`ConsumeMetrics`).
consume_metrics = ConsumeMetrics()
