"""Publish events to Apache Kafka (or a Kafka-protocol broker) with
confluent-kafka, librdkafka's Python client.

The producer is always idempotent (``enable.idempotence=true``, so
``acks=all``): the broker drops a retry of a batch it already wrote, and
librdkafka's retries cannot reorder one partition's records. Every record of
an aggregate has the same key, so it goes to one partition, in publish order.

A batch is pipelined like a RabbitMQ batch's confirms: :meth:`send` hands every
record of the batch to librdkafka, which sends many at once, and
:meth:`collect` serves the delivery reports until each record of the batch has
one (bounded by ``DELIVERY_TIMEOUT``). A delivery is reported delivered only
once its report says the broker has the record. Reports are served in the
calling thread (``poll``), so the publisher starts no thread of its own besides
librdkafka's.

An idempotent producer's id is the broker's: after an outage (a broker
restarted without its state, a producer id that expired or was fenced) the old
producer may never be able to write again, so the publisher drops it and
builds a new one for the next batch.
"""

from __future__ import annotations

import functools
import logging
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any

from ..conf import positive_number
from ..exceptions import (
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
    UndeliverableMessage,
)
from ..subscribers import DeliveryContext
from .base import (
    COMMON_OPTIONS,
    DERIVED_FIELDS,
    Publisher,
    config_error,
    encode_each,
    failure,
    render,
    template_fields,
    wire_format,
)

DEFAULT_TOPIC = "{aggregate_type}"
DEFAULT_KEY = "{aggregate_id}"
OWN_OPTIONS = frozenset(
    {"BOOTSTRAP_SERVERS", "TOPIC", "KEY", "FORMAT", "CONFIG", "DELIVERY_TIMEOUT"}
)
#: librdkafka settings the publisher sets itself: ``CONFIG`` may not.
RESERVED_CONFIG = frozenset(
    {
        "bootstrap.servers",
        "metadata.broker.list",
        "enable.idempotence",
        "acks",
        "request.required.acks",
        "message.timeout.ms",
        "delivery.timeout.ms",
        "transactional.id",
        "error_cb",
        "on_delivery",
        "delivery.report.only.error",
    }
)
#: A topic name: at most 249 of these characters, not ``.`` or ``..``.
TOPIC_CHARACTER = re.compile(r"[^a-zA-Z0-9._-]")
MAX_TOPIC_LENGTH = 249
NOT_INSTALLED = "confluent-kafka is not installed: pip install 'outbox_app[kafka]'"
#: Topics kept sanitised, by rendered name (a bound on the cache).
TOPIC_CACHE_SIZE = 4096
#: Seconds a batch still waits for reports after librdkafka said every
#: broker is down (it says so too when idle connections were closed, and
#: reconnects when records are to be sent).
DOWN_GRACE = 1.0
#: Seconds of one metadata request of :meth:`KafkaPublisher.probe`, between
#: which the error callback is served (a refused connection ends the probe).
PROBE_STEP = 0.25

logger = logging.getLogger("outbox_app.publishers.kafka")

_WAITING: Any = object()


class KafkaPublisher(Publisher):
    """A publisher to a Kafka cluster.

    Options (besides the common ones of :class:`~outbox_app.publishers.base.Publisher`):

    ``BOOTSTRAP_SERVERS`` (required)
        ``"host:9092"``, ``"host1:9092,host2:9092"`` or a list of
        ``host:port``.
    ``TOPIC`` (default ``"{aggregate_type}"``)
        :meth:`str.format` template over the
        :class:`~outbox_app.subscribers.DeliveryContext` fields, as
        ``KombuPublisher``'s ``ROUTING_KEY``; a ``None`` field formats as
        ``""``. The result is sanitised to Kafka's topic alphabet: each
        character other than ASCII letters, digits, ``.``, ``_`` and ``-``
        becomes ``_`` (``shop.Order`` stays ``shop.Order``).
        ``"outbox.event.{aggregate_type}"`` names topics as Debezium's outbox
        event router does.
    ``KEY`` (default ``"{aggregate_id}"``)
        Template of the record key (UTF-8); an empty key (an event without an
        aggregate) is sent as no key.
    ``FORMAT`` (default ``"cloudevents"``)
        ``"cloudevents"``: the value is the event's CloudEvents JSON envelope
        (:func:`~outbox_app.publishers.cloudevents.body`), structured mode, with
        the header ``content-type: application/cloudevents+json`` (CloudEvents
        Kafka protocol binding, section 3.2). ``"debezium"``: the value is the
        payload's JSON, with the headers ``id`` (the event id) and
        ``eventType``, as Debezium's outbox event router sends.
        ``"corewrite"``: the CoreWrite JSON object
        (:mod:`~outbox_app.publishers.corewrite`), header ``content-type:
        application/json``.
    ``DELIVERY_TIMEOUT`` (default ``10``)
        Seconds a record may take from :meth:`send` to its delivery report
        (librdkafka's ``message.timeout.ms``), and the bound on
        :meth:`collect`, :meth:`probe` and :meth:`close`.
    ``CONFIG`` (default ``{}``)
        Further librdkafka settings (``compression.type``, ``linger.ms``,
        ``security.protocol``, ``sasl.username``, ...). The ones in
        :data:`RESERVED_CONFIG` are the publisher's own.

    Behaviour: a record is reported delivered once its delivery report says
    the broker has it. A report with an error fails that record alone: a
    record too large (``MSG_SIZE_TOO_LARGE``, from librdkafka's
    ``message.max.bytes`` or the broker) or a topic name Kafka refuses with
    :class:`~outbox_app.exceptions.UndeliverableMessage` (it goes to the dead
    letter at once); a topic that does not exist (and is not created) with
    :class:`~outbox_app.exceptions.MessageUnroutable`; any other refusal
    (``TOPIC_AUTHORIZATION_FAILED``, a policy) with
    :class:`~outbox_app.exceptions.MessageRejected`; each message starts with
    the error's name. A cluster that cannot be reached (every broker down),
    a record with no report within ``DELIVERY_TIMEOUT``, a report of a
    cluster error librdkafka retried until then (``NOT_ENOUGH_REPLICAS``,
    ``NOT_LEADER_FOR_PARTITION``, ...: :data:`_CLUSTER_ERRORS`), or a
    producer librdkafka declares fatally broken, fail the records with
    :class:`~outbox_app.exceptions.PublisherUnavailable` (the relay pauses
    the publisher and counts no attempt); the producer is then dropped, and
    the next batch, or :meth:`probe`, builds a new one.

    confluent-kafka is imported when the first producer is built: the options
    are checked without it, ``manage.py check`` warns when it is missing
    (``outbox.W007``), and a batch fails with ``PublisherUnavailable`` until
    it is installed.

    One instance is used by one thread at a time: ``registry.publishers()``
    builds one per thread.

    Raises:
        ImproperlyConfigured: a missing ``BOOTSTRAP_SERVERS``, or a malformed
            or unknown option (a ``CONFIG`` librdkafka refuses too, when
            confluent-kafka is installed).
    """

    def __init__(self, name: str, options: Mapping[str, Any]):
        super().__init__(name, options)
        unknown = set(options) - COMMON_OPTIONS - OWN_OPTIONS
        if unknown:
            raise config_error(name, f"unknown option(s) {sorted(unknown)}")
        servers = options.get("BOOTSTRAP_SERVERS")
        if isinstance(servers, list | tuple) and all(
            isinstance(s, str) and s for s in servers
        ):
            servers = ",".join(servers)
        if not isinstance(servers, str) or not servers.strip():
            raise config_error(
                name,
                "'BOOTSTRAP_SERVERS' is required: 'host:9092' or a list of "
                f"'host:port', got {servers!r}",
            )
        self.wire = wire_format(name, options)
        timeout = options.get("DELIVERY_TIMEOUT", 10)
        if not positive_number(timeout):
            raise config_error(
                name,
                f"'DELIVERY_TIMEOUT' must be a positive number of seconds, got "
                f"{timeout!r}",
            )
        config = options.get("CONFIG", {})
        if not isinstance(config, Mapping) or not all(
            isinstance(k, str) for k in config
        ):
            raise config_error(name, "'CONFIG' must be a dict of librdkafka settings")
        reserved = sorted(RESERVED_CONFIG & set(config))
        if reserved:
            raise config_error(
                name, f"'CONFIG' may not set {reserved}: the publisher does"
            )

        self.servers = servers
        self.topic = options.get("TOPIC", DEFAULT_TOPIC)
        self._topic_fields = template_fields(name, "TOPIC", self.topic)
        self.key = options.get("KEY", DEFAULT_KEY)
        self._key_fields = template_fields(name, "KEY", self.key)
        self.format = options.get("FORMAT", "cloudevents")
        self._render_topic = _renderer(self.topic, self._topic_fields, self.wire)
        self._render_key = _renderer(self.key, self._key_fields, self.wire)
        #: The headers of every record but Debezium's (confluent-kafka copies
        #: them into each record: one list serves all).
        self._headers = [("content-type", self.wire.content_type.encode())]
        self.delivery_timeout = float(timeout)
        self.config = {
            "client.id": f"outbox-{name}",
            "logger": _LIBRDKAFKA_LOG,
            **config,
            "bootstrap.servers": servers,
            "enable.idempotence": True,
            "acks": "all",
            "message.timeout.ms": int(self.delivery_timeout * 1000),
        }
        self._topics: dict[str, str] = {}
        self._producer: Any = None
        #: What librdkafka's error callback said of the producer: every broker
        #: is down (``_down``), or it cannot go on (``_fatal``); None: nothing.
        self._down: str | None = None
        self._fatal: str | None = None
        try:
            import confluent_kafka
        except ImportError:
            return
        try:  # librdkafka checks the settings; no broker is contacted
            confluent_kafka.Producer(
                {k: v for k, v in self.config.items() if k != "bootstrap.servers"}
                | {"log_level": 0}
            ).close(0)
        except (confluent_kafka.KafkaException, TypeError, ValueError) as exc:
            raise config_error(name, f"'CONFIG' refused by librdkafka: {exc}") from exc

    # --- the interface --------------------------------------------------------

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        """Produce ``messages`` and wait for their delivery reports
        (:meth:`send`, then :meth:`collect`)."""
        return self.collect(self.send(messages))

    def send(self, messages: Sequence[DeliveryContext]) -> _InFlight:
        """Hand ``messages`` to the producer without waiting for their
        delivery reports.

        A message that cannot be encoded (a topic that is empty, ``.``,
        ``..`` or longer than 249 characters; a field a template needs is
        missing), or that librdkafka refuses at once (larger than its
        ``message.max.bytes``), fails alone with
        :class:`~outbox_app.exceptions.UndeliverableMessage`. Without
        confluent-kafka, every message fails with
        :class:`~outbox_app.exceptions.PublisherUnavailable`. Never raises for
        a message or the cluster.
        """
        flight = _InFlight(len(messages), time.monotonic() + self.delivery_timeout)
        ready, refused = encode_each(messages, self._encode)  # (index, topic, ...)
        for index, error in refused.items():
            flight.settle(index, error)
        if not ready:
            return flight
        try:
            producer = self._connect()
        except ImportError as exc:
            error = failure(PublisherUnavailable, NOT_INSTALLED, exc)
            for index, *_ in ready:
                flight.settle(index, error)
            return flight
        flight.producer = producer
        produce, report = producer.produce, flight.report
        for index, topic, key, value, headers in ready:
            flight.waiting += 1
            while True:
                try:
                    produce(
                        topic,
                        value,
                        key,
                        headers=headers,
                        on_delivery=functools.partial(report, index),
                    )
                    break
                except BufferError:  # librdkafka's queue is full: make room
                    producer.poll(0.05)
                    if time.monotonic() < flight.deadline:
                        continue
                    flight.report(index, _QueueFull(), None)
                    break
                except Exception as exc:  # KafkaException: refused at once
                    flight.report(index, _kafka_error(exc), None)
                    break
        producer.poll(0)
        return flight

    def collect(self, sent: _InFlight) -> list[BaseException | None]:
        """Serve delivery reports until every message of ``sent`` has one, at
        most ``DELIVERY_TIMEOUT`` from its :meth:`send`; one outcome per
        message, in order. Messages still waiting then (every broker down, the
        timeout, a fatal producer error) fail with
        :class:`~outbox_app.exceptions.PublisherUnavailable`, and the producer
        is dropped."""
        producer = sent.producer
        current = producer is not None and producer is self._producer
        down_since = None  # when the producer said every broker is down
        while sent.waiting and current:
            now = time.monotonic()
            if now >= sent.deadline or self._fatal is not None:
                break
            if self._down is not None:
                if down_since is None:
                    down_since, waiting = now, sent.waiting
                elif sent.waiting < waiting:  # reports again: brokers are back
                    self._down = down_since = None
                elif now - down_since >= DOWN_GRACE:
                    break
            producer.poll(min(sent.deadline - now, 0.05))
        if sent.waiting:
            if not current:
                reason = (
                    f"the producer was dropped after an outage of the Kafka "
                    f"cluster {self.servers} before it reported"
                )
            elif (self._fatal or self._down) is not None:
                reason = (
                    f"cannot reach the Kafka cluster {self.servers}: "
                    f"{self._fatal or self._down}"
                )
            else:
                reason = (
                    f"no delivery report from the Kafka cluster {self.servers} "
                    f"within {self.delivery_timeout:g} s"
                )
            error = PublisherUnavailable(
                f"{reason}; the record may or may not be in its topic (sent "
                "again, a consumer sees it twice)"
            )
            sent.fail_waiting(error)
        results = sent.judged(self)
        if current and any(isinstance(r, PublisherUnavailable) for r in results):
            self._drop()  # a new producer for the next batch
        return results

    def probe(self) -> None:
        """Build a producer if there is none and read the cluster's metadata.

        Raises:
            PublisherUnavailable: confluent-kafka is missing, or no broker
                answered within ``DELIVERY_TIMEOUT``.
        """
        deadline = time.monotonic() + self.delivery_timeout
        error: Exception | None = None
        try:
            producer = self._connect()
            while time.monotonic() < deadline:
                try:
                    producer.list_topics(timeout=PROBE_STEP)
                except Exception as exc:
                    error = exc
                else:
                    if self._fatal is None:
                        self._down = None
                        return
                producer.poll(0)  # the error callback: refused, fatal
                if (self._fatal or self._down) is not None:
                    break
        except ImportError as exc:
            raise failure(PublisherUnavailable, NOT_INSTALLED, exc) from exc
        except Exception as exc:
            error = exc
        self._drop()
        reason = self._fatal or self._down or (_text(error) if error else "timeout")
        raise failure(
            PublisherUnavailable,
            f"cannot reach the Kafka cluster {self.servers}: {reason}",
            error,
        )

    def close(self) -> None:
        """Wait for the records in flight (at most ``DELIVERY_TIMEOUT``), then
        close the producer."""
        producer = self._producer
        if producer is None:
            return
        try:
            producer.flush(self.delivery_timeout)
        finally:
            self._drop()

    def missing_packages(self) -> list[str]:
        """``["'outbox_app[kafka]'"]`` without confluent-kafka."""
        try:
            import confluent_kafka  # noqa: F401
        except ImportError:
            return ["'outbox_app[kafka]'"]
        return []

    # --- encoding -------------------------------------------------------------

    def _encode(
        self, context: DeliveryContext
    ) -> tuple[str, bytes | None, bytes, list]:
        rendered = self._render_topic(context)
        topic = self._topics.get(rendered) or self._topic_of(rendered)
        key = self._render_key(context).encode() or None
        value = self.wire.body(context)
        if self.format == "debezium":  # as Debezium's outbox event router
            headers = [
                ("id", str(context.event_id).encode()),
                ("eventType", context.event_type.encode()),
            ]
        else:
            headers = self._headers
        return topic, key, value, headers

    def _topic_of(self, rendered: str) -> str:
        """``rendered`` in Kafka's topic alphabet.

        Raises:
            ValueError: empty, ``.``, ``..`` or over 249 characters.
        """
        topic = self._topics.get(rendered)
        if topic is not None:
            return topic
        topic = TOPIC_CHARACTER.sub("_", rendered)
        if topic in ("", ".", "..") or len(topic) > MAX_TOPIC_LENGTH:
            raise ValueError(
                f"{topic[:60]!r} is not a Kafka topic name (empty, '.', '..' or "
                f"over {MAX_TOPIC_LENGTH} characters; template {self.topic!r})"
            )
        if len(self._topics) >= TOPIC_CACHE_SIZE:
            self._topics.clear()
        self._topics[rendered] = topic
        return topic

    # --- the producer ---------------------------------------------------------

    def _connect(self) -> Any:
        """The producer; builds one if there is none. Raises ImportError
        without confluent-kafka."""
        if self._producer is None:
            import confluent_kafka

            self._down = self._fatal = None
            self._producer = confluent_kafka.Producer(
                {**self.config, "error_cb": self._on_error}
            )
        return self._producer

    def _on_error(self, error: Any) -> None:
        """librdkafka's error callback (served by ``poll``): a producer that
        cannot go on stops the batches' waiting at once, every broker down
        after :data:`DOWN_GRACE` without a report; the others are logged."""
        from confluent_kafka import KafkaError

        text = f"{error.name()}: {error.str()}"
        if error.fatal() or error.code() == KafkaError._AUTHENTICATION:
            self._fatal = text
        elif error.code() == KafkaError._ALL_BROKERS_DOWN:
            self._down = text
        else:
            logger.debug("publisher %s: %s", self.name, error.str())

    def _drop(self) -> None:
        """Purge what the producer still holds (its delivery reports fail the
        messages waiting as unavailable) and close it."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.purge()
            producer.poll(0)  # the purged records' reports
            producer.close(0)
        except Exception:
            logger.debug("publisher %s: closing the producer", self.name, exc_info=True)


def _renderer(template: str, used: frozenset[str], wire: Any) -> Any:
    """A function of a context rendering ``template`` as :func:`render`
    does; for a template that is one plain field (the default topic and key),
    that field's text without building the mapping ``render`` formats."""
    name = next(iter(used)) if len(used) == 1 else None
    if (
        name is not None
        and template == "{" + name + "}"
        and name not in DERIVED_FIELDS
        and name != "operation"
    ):

        def field(context: DeliveryContext) -> str:
            value = getattr(context, name)
            return "" if value is None else format(value)

        return field
    return functools.partial(render, template, used, wire=wire)


class _LibrdkafkaLog:
    """Where librdkafka's log lines go (its ``logger`` setting): the debug
    level of this module's logger, since a relay reports an outage once, as a
    pause, rather than each refused reconnect."""

    def log(self, level: int, message: str, *args: Any) -> None:
        logger.debug(message, *args)


_LIBRDKAFKA_LOG = _LibrdkafkaLog()


class _InFlight:
    """One batch handed to :meth:`KafkaPublisher.send`: per message its
    outcome (an exception, None) or its delivery report's error."""

    def __init__(self, size: int, deadline: float):
        self.outcomes: list[Any] = [_WAITING] * size
        self.deadline = deadline
        self.waiting = 0  # messages produced and not reported
        self.producer: Any = None  # the producer they were handed to
        self.reported_errors = False  # a report with an error came

    def settle(self, index: int, outcome: BaseException | None) -> None:
        self.outcomes[index] = outcome

    def report(self, index: int, error: Any, message: Any) -> None:
        """The delivery report of message ``index`` (librdkafka's
        ``on_delivery``): its KafkaError, or None (delivered)."""
        if self.outcomes[index] is _WAITING:
            self.outcomes[index] = None if error is None else _Reported(error)
            self.waiting -= 1
            if error is not None:
                self.reported_errors = True

    def fail_waiting(self, error: BaseException) -> None:
        for index, outcome in enumerate(self.outcomes):
            if outcome is _WAITING:
                self.outcomes[index] = error
        self.waiting = 0

    def judged(self, publisher: KafkaPublisher) -> list[BaseException | None]:
        """The outcomes, each report's error judged (:func:`_outcome`)."""
        if self.reported_errors:
            self.outcomes = [
                _outcome(publisher, o.error) if isinstance(o, _Reported) else o
                for o in self.outcomes
            ]
            self.reported_errors = False
        return list(self.outcomes)


class _Reported:
    __slots__ = ("error",)

    def __init__(self, error: Any):
        self.error = error


class _QueueFull:
    """A stand-in KafkaError for a record librdkafka's full queue did not take
    within ``DELIVERY_TIMEOUT``."""

    def name(self) -> str:
        return "_QUEUE_FULL"

    def str(self) -> str:
        return "librdkafka's local queue stayed full"

    def code(self) -> Any:
        return None

    def fatal(self) -> bool:
        return False

    def retriable(self) -> bool:
        return True


#: Report errors of the cluster rather than of the record (librdkafka retried
#: them until the record's timeout): an outage.
_CLUSTER_ERRORS = frozenset(
    {
        "_MSG_TIMED_OUT",
        "_TIMED_OUT",
        "_TIMED_OUT_QUEUE",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_PURGE_QUEUE",
        "_PURGE_INFLIGHT",
        "_QUEUE_FULL",
        "NOT_ENOUGH_REPLICAS",
        "NOT_ENOUGH_REPLICAS_AFTER_APPEND",
        "LEADER_NOT_AVAILABLE",
        "NOT_LEADER_FOR_PARTITION",
        "BROKER_NOT_AVAILABLE",
        "REQUEST_TIMED_OUT",
        "NETWORK_EXCEPTION",
        "KAFKA_STORAGE_ERROR",
        "UNKNOWN_PRODUCER_ID",
        "OUT_OF_ORDER_SEQUENCE_NUMBER",
    }
)


def _outcome(publisher: KafkaPublisher, error: Any) -> BaseException | None:
    """The outcome of a record from its delivery report's ``error``."""
    if error is None:
        return None
    from confluent_kafka import KafkaError

    code, name = error.code(), error.name()
    text = f"{name}: {error.str()}"
    if code in (
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError._INVALID_ARG,
    ):
        return UndeliverableMessage(f"{text} (Kafka can never take this record)")
    if code in (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC):
        return MessageUnroutable(
            f"{text} (the topic does not exist and the cluster does not create "
            "it: create it, then requeue)"
        )
    if error.fatal() or error.retriable() or name in _CLUSTER_ERRORS:
        return PublisherUnavailable(
            f"{text} (from the Kafka cluster {publisher.servers}; the record may "
            "or may not be in its topic)"
        )
    return MessageRejected(f"{text} (Kafka refused the record)")


def _kafka_error(exc: Exception) -> Any:
    """The KafkaError a ``produce`` call raised (a KafkaException's first
    argument); a stand-in for anything else."""
    error = exc.args[0] if exc.args else None
    if hasattr(error, "code") and hasattr(error, "fatal"):
        return error
    return _Refused(exc)


class _Refused:
    """A stand-in KafkaError for an exception ``produce`` raised that is not
    a KafkaException (a value confluent-kafka cannot send)."""

    def __init__(self, exc: Exception):
        self.exc = exc

    def name(self) -> str:
        return type(self.exc).__name__

    def str(self) -> str:
        return str(self.exc)

    def code(self) -> Any:
        from confluent_kafka import KafkaError

        return KafkaError._INVALID_ARG

    def fatal(self) -> bool:
        return False

    def retriable(self) -> bool:
        return False


def _text(exc: BaseException) -> str:
    error = exc.args[0] if exc.args else None
    if hasattr(error, "name") and hasattr(error, "str"):
        return f"{error.name()}: {error.str()}"
    return str(exc)
