"""Publish events to any broker kombu speaks: RabbitMQ, Redis, in-memory.

On RabbitMQ (kombu's ``pyamqp`` transport) a batch is published with pipelined
publisher confirms: every message of the batch is written (:meth:`send`), and
the broker's ``basic.ack`` / ``basic.nack`` / ``basic.return`` frames are read
afterwards (:meth:`collect`), so a batch of 500 costs about one round trip
instead of 500: ~12x the throughput of waiting for each confirm
(docs/brokers.md, "Delivery guarantees"). The relay sends the next batch
before it collects this one's confirms, so the broker always has a batch to
persist. kombu's ``Producer`` with ``confirm_publish`` waits message by
message, so this module works on the py-amqp channel underneath kombu. While a
batch's frames are written with one system call, so the broker reads full
segments rather than one packet per message.

Other transports have no confirms: a publish that returns without an error
counts as delivered.
"""

from __future__ import annotations

import contextlib
import math
import re
import struct
import time
from collections import defaultdict, deque
from collections.abc import Mapping, Sequence
from typing import Any

import amqp
import amqp.exceptions
import kombu.exceptions
from kombu import Connection, Exchange, Producer, Queue
from kombu.transport import pyamqp

from ..conf import mask_url
from ..exceptions import (
    DeliveryError,
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
    UndeliverableMessage,
)
from ..store.clock import database_now
from ..subscribers import DeliveryContext
from .amqp_frames import MAX_SHORTSTR_BYTES, PublishFrames
from .base import (
    COMMON_OPTIONS,
    Publisher,
    config_error,
    encode_each,
    failure,
    render,
    template_fields,
    undeliverable,
    wire_format,
)

DEFAULT_ROUTING_KEY = "{aggregate_type}.{event_type}"
EXCHANGE_TYPES = ("topic", "direct", "fanout", "headers")
OWN_OPTIONS = {
    "URL",
    "EXCHANGE",
    "EXCHANGE_TYPE",
    "ROUTING_KEY",
    "CONFIRM_TIMEOUT",
    "DECLARE",
    "TRANSPORT_OPTIONS",
    "CONNECT_RETRIES",
    "FORMAT",
}
#: Errors of encoding one message: raised before any of it is written
#: (a short string over 255 bytes: ``amqp_frames.shortstr``), so they are
#: about the message, never the connection.
ENCODING_ERRORS = (
    struct.error,
    ValueError,
    amqp.exceptions.FrameSyntaxError,
    kombu.exceptions.EncodeError,
)
#: RabbitMQ's reason for closing the channel of a message over its
#: ``max_message_size`` (406 PRECONDITION_FAILED).
_TOO_LARGE = re.compile(r"larger than configured max size (\d+)")

_PENDING: Any = object()


class KombuPublisher(Publisher):
    """A publisher to one kombu exchange; the default ``BACKEND``.

    Options (besides the common ones of :class:`~outbox_app.publishers.base.Publisher`):

    ``URL`` (required)
        kombu connection URL: ``amqp://guest:guest@127.0.0.1:5672//`` (RabbitMQ),
        ``redis://127.0.0.1:6379/0``, ``memory://`` (in-process, tests and demos).
    ``EXCHANGE`` (default ``"outbox"``)
        Exchange name. Declared durable, once per connection.
    ``EXCHANGE_TYPE`` (default ``"topic"``)
        ``topic``, ``direct``, ``fanout`` or ``headers``.
    ``ROUTING_KEY`` (default ``"{aggregate_type}.{event_type}"``; with
    ``FORMAT`` ``corewrite``, ``"{dimension}.{operation}"``)
        :meth:`str.format` template over the
        :class:`~outbox_app.subscribers.DeliveryContext` fields (``event_type``,
        ``aggregate_type``, ``aggregate_id``, ``namespace``, ``tenant_id``,
        ``revision``, ``operation``, ...) and ``dimension`` (the aggregate
        type lower-cased); a ``None`` field formats as ``""``.
    ``FORMAT`` (default ``"cloudevents"``)
        The body: ``cloudevents`` (the CloudEvents JSON envelope, content type
        ``application/cloudevents+json``) or ``corewrite`` (the CoreWrite
        JSON object of :mod:`~outbox_app.publishers.corewrite`, content type
        ``application/json``; ``{operation}`` in the routing key is then
        ``post``, ``patch`` or ``delete``).
    ``CONFIRM_TIMEOUT`` (default ``10``)
        Seconds to wait for a batch's publisher confirms (RabbitMQ), and the
        bound on each socket write or broker reply of the batch. Unconfirmed
        messages then fail; they may still reach the queue (at least once).
    ``DECLARE`` (default ``[]``)
        Queue names to declare (durable) and bind to the exchange with routing
        key ``"#"`` (every message on a topic exchange), once per connection. A
        convenience for simple setups; consumers normally declare their own.
    ``TRANSPORT_OPTIONS`` (default ``{}``)
        Passed to kombu's ``Connection(transport_options=...)``.
        ``confirm_publish`` is ignored: confirms are always on for AMQP.
    ``CONNECT_RETRIES`` (default ``2``)
        Connection attempts retried within one ``send_batch`` before its
        messages fail (and are retried by the relay with backoff).

    Behaviour: each message is the event in its ``FORMAT`` (by default the
    CloudEvents JSON envelope,
    :func:`~outbox_app.publishers.cloudevents.to_cloudevent`), persistent (delivery
    mode 2), with the event id as ``message_id`` and the event type as ``type``. An
    event published with ``expires_at`` carries the time it has left as the
    message's ``expiration`` (milliseconds): RabbitMQ drops it from the queues it
    reaches once that passes (per-message TTL; kombu's Redis transport ignores it,
    and ``manage.py consume`` drops a message whose CloudEvents ``expiretime`` has
    passed wherever it came from). On AMQP it is published ``mandatory``: a message
    no queue is bound for comes back (``basic.return``) and fails as unroutable. A
    message is reported delivered only after the broker's ``basic.ack``. A
    ``basic.nack`` or a return fails it with a
    :class:`~outbox_app.exceptions.DeliveryError` (an attempt, retried with
    backoff). A message the broker can never take fails alone with
    :class:`~outbox_app.exceptions.UndeliverableMessage` (it goes to the dead letter
    at once; the rest of the batch is delivered): one that cannot be encoded (on
    AMQP a routing key, ``type`` or ``message_id`` over 255 UTF-8 bytes), or a body
    over RabbitMQ's ``max_message_size`` (RabbitMQ closes the channel: the publisher
    learns the limit from its reason, sends the other unconfirmed messages again at
    once on a new connection, and refuses larger bodies itself from then on). On
    other transports an error that is not about the connection fails that message
    alone, as an attempt. A connection that cannot be opened or is lost, or the
    confirm timeout, fails the messages with
    :class:`~outbox_app.exceptions.PublisherUnavailable` (the relay pauses the
    publisher and counts no attempt). After a connection error or timeout the
    connection is dropped; the next batch, or :meth:`probe`, reconnects.

    One instance is used by one thread at a time: ``registry.publishers()``
    builds one per thread.

    Raises:
        ImproperlyConfigured: a missing ``URL`` or a malformed or unknown option.
    """

    def __init__(self, name: str, options: Mapping[str, Any]):
        super().__init__(name, options)
        unknown = set(options) - COMMON_OPTIONS - OWN_OPTIONS
        if unknown:
            raise config_error(name, f"unknown option(s) {sorted(unknown)}")
        url = options.get("URL")
        if not isinstance(url, str) or not url:
            raise config_error(
                name, "'URL' is required, e.g. 'amqp://guest:guest@host//'"
            )
        exchange = options.get("EXCHANGE", "outbox")
        exchange_type = options.get("EXCHANGE_TYPE", "topic")
        if not isinstance(exchange, str) or exchange_type not in EXCHANGE_TYPES:
            raise config_error(
                name,
                f"'EXCHANGE' must be a name and 'EXCHANGE_TYPE' one of "
                f"{EXCHANGE_TYPES}, got {exchange!r}, {exchange_type!r}",
            )
        timeout = options.get("CONFIRM_TIMEOUT", 10)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise config_error(
                name, f"'CONFIRM_TIMEOUT' must be seconds, got {timeout!r}"
            )
        if timeout <= 0:
            raise config_error(
                name, f"'CONFIRM_TIMEOUT' must be positive, got {timeout!r}"
            )
        declare = options.get("DECLARE", [])
        if isinstance(declare, str) or not all(isinstance(q, str) for q in declare):
            raise config_error(
                name, f"'DECLARE' must be a list of queue names: {declare!r}"
            )
        transport_options = options.get("TRANSPORT_OPTIONS", {})
        if not isinstance(transport_options, Mapping):
            raise config_error(name, "'TRANSPORT_OPTIONS' must be a dict")
        retries = options.get("CONNECT_RETRIES", 2)
        if isinstance(retries, bool) or not isinstance(retries, int) or retries < 0:
            raise config_error(name, f"'CONNECT_RETRIES' must be >= 0, got {retries!r}")

        self.url = url
        self.where = mask_url(url)  # for messages and logs
        try:
            transport = Connection(url).transport
        except ImportError as exc:  # e.g. redis:// without the redis library
            raise config_error(
                name, f"'URL' {self.where!r} needs a missing library: {exc}"
            ) from exc
        except Exception as exc:
            raise config_error(
                name, f"'URL' {self.where!r} is not a kombu URL: {mask_url(str(exc))}"
            ) from exc
        #: RabbitMQ through py-amqp: publisher confirms and mandatory publishing.
        self.amqp = isinstance(transport, pyamqp.Transport)
        self.exchange = Exchange(exchange, type=exchange_type, durable=True)
        self.wire = wire_format(name, options)
        self.routing_key = options.get(
            "ROUTING_KEY", self.wire.default_key or DEFAULT_ROUTING_KEY
        )
        self._key_fields = template_fields(name, "ROUTING_KEY", self.routing_key)
        self.confirm_timeout = float(timeout)
        self.queues = [
            Queue(q, self.exchange, routing_key="#", durable=True) for q in declare
        ]
        self.transport_options = {
            k: v for k, v in transport_options.items() if k != "confirm_publish"
        }
        self.connect_retries = retries
        self._connection: Connection | None = None
        self._raw: amqp.Connection | None = None  # AMQP: py-amqp's connection
        self._channel: Any = None  # a py-amqp channel (AMQP) or kombu Producer
        self._next_tag = 1  # delivery tag of the next publish on the channel
        #: Largest body the broker takes, in bytes: learned when RabbitMQ
        #: refused a larger one (None: not known).
        self.max_body: int | None = None
        #: The connection RabbitMQ closed a channel of for a message over
        #: ``max_body``, and its reason: batches written on it are sent again.
        self._refused: Any = None
        self._refusal = ""

    # --- the interface --------------------------------------------------------

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        """Publish ``messages`` and wait for their confirms; ``None`` for each
        one the broker confirmed (:meth:`send`, then :meth:`collect`)."""
        return self.collect(self.send(messages))

    def send(self, messages: Sequence[DeliveryContext]) -> _InFlight:
        """Publish ``messages`` without waiting for their confirms.

        Messages that cannot be encoded (a routing key, ``type`` or
        ``message_id`` over 255 bytes, a field the template needs is
        missing, a body over the broker's known limit) fail alone, with
        :class:`~outbox_app.exceptions.UndeliverableMessage`; the rest of the
        batch is published. A connection that cannot be opened or breaks fails
        the messages with
        :class:`~outbox_app.exceptions.PublisherUnavailable`.
        """
        # (index, body, routing key, message id, event type, ttl)
        ready, refused = encode_each(messages, self._encode)
        outcomes = [refused.get(i, _PENDING) for i in range(len(messages))]
        flight = _InFlight(outcomes, [r[0] for r in ready], messages)
        if not ready:
            return flight
        try:
            self._connect()
        except Exception as exc:
            self._drop()
            message = f"cannot connect to {self.where}: {exc}"
            flight.settle_all(failure(PublisherUnavailable, message, exc))
            return flight
        if self.amqp:
            self._publish_confirmed(ready, flight)
        else:
            flight.settle(self._send_plain(ready))
        return flight

    def collect(self, sent: _InFlight) -> list[BaseException | None]:
        """Wait (at most ``CONFIRM_TIMEOUT`` from the publish) for the confirms
        of what :meth:`send` published; one outcome per message, in order."""
        confirms = sent.confirms
        if confirms is not None:
            try:
                self._await(sent)
            finally:
                self._forget(confirms)
            if sent.refused:
                self._send_again(sent)
            sent.settle(confirms.outcomes)
        return sent.outcomes

    def probe(self) -> None:
        """Open the connection and channel (no retries): raises while the
        broker is unreachable."""
        try:
            self._connect(retries=0)
        except Exception:
            self._drop()
            raise

    def close(self) -> None:
        """Close the connection (bounded by ``CONFIRM_TIMEOUT``)."""
        connection = self._connection
        if connection is None:
            return
        try:
            if self.amqp:
                with self._raw.transport.having_timeout(self.confirm_timeout):
                    connection.release()
            else:
                connection.release()
        except Exception:
            self._drop()
        self._connection = self._raw = self._channel = None

    # --- encoding -------------------------------------------------------------

    def _encode(
        self, context: DeliveryContext
    ) -> tuple[bytes, str, str, str, int | None]:
        body = self.wire.body(context)
        key = render(self.routing_key, self._key_fields, context, self.wire)
        if len(key.encode()) > MAX_SHORTSTR_BYTES:
            raise ValueError(f"routing key longer than 255 bytes: {key[:60]!r}...")
        message_id, event_type = str(context.event_id), context.event_type
        if self.max_body is not None and len(body) > self.max_body:
            raise ValueError(
                f"the message is {len(body)} bytes; the broker takes at most "
                f"{self.max_body} (its max_message_size: it refused a larger "
                f"one, {self._refusal})"
            )
        return body, key, message_id, event_type, _ttl(context)

    # --- connection -----------------------------------------------------------

    def _connect(self, retries: int | None = None) -> None:
        """Open the connection and channel unless they are open and alive."""
        if self._connection is not None and self._alive():
            return
        self._drop()
        connection = Connection(self.url, transport_options=self.transport_options)
        self._connection = connection
        connection.ensure_connection(
            max_retries=self.connect_retries if retries is None else retries,
            interval_start=0.5,
            interval_step=0.5,
            interval_max=2,
        )
        if self.amqp:
            raw = self._raw = connection.connection
            with raw.transport.having_timeout(self.confirm_timeout):
                channel = raw.channel()
                self._declare(channel)
                channel.confirm_select()
            # py-amqp reads the socket before every publish when the broker may
            # send connection.blocked (four system calls a message); the relay
            # reads what the broker sent, blocked notices included, when it
            # collects the confirms, and a blocked broker shows as a confirm
            # timeout. So the per-message read is switched off.
            capabilities = dict(raw.client_properties.get("capabilities", {}))
            capabilities["connection.blocked"] = False
            raw.client_properties = {
                **raw.client_properties,
                "capabilities": capabilities,
            }
            self._channel, self._next_tag = channel, 1
            self._frames = PublishFrames(
                channel.channel_id,
                raw.frame_max,
                self.exchange.name,
                self.wire.content_type,
                "utf-8",
            )
        else:
            channel = connection.channel()
            self._declare(channel)
            self._channel = Producer(channel, self.exchange, auto_declare=False)

    def _declare(self, channel) -> None:
        self.exchange(channel).declare()
        for queue in self.queues:
            queue(channel).declare()

    def _alive(self) -> bool:
        """Read what the broker sent since the last batch (a Connection.Close
        after a broker restart, say); False if the connection is gone."""
        if not self.amqp:
            return self._connection.connected
        try:
            self._raw.drain_events(timeout=0)
        except TimeoutError:
            return True  # nothing to read: the usual case
        except Exception as exc:
            self._too_large(exc)
            return False
        return self._raw.connected

    def _drop(self) -> None:
        """Forget the connection without talking to the broker."""
        connection = self._connection
        self._connection = self._raw = self._channel = None
        if connection is not None:
            with contextlib.suppress(Exception):
                if self.amqp:
                    connection.collect()  # closes the socket; no handshake
                else:
                    connection.release()

    # --- publishing -----------------------------------------------------------

    def _send_plain(self, ready: list) -> list[BaseException | None]:
        """Publish with kombu's Producer: a transport without confirms."""
        producer: Producer = self._channel
        lost = (OSError, *self._connection.connection_errors)
        outcomes: list[BaseException | None] = []
        for _, body, key, message_id, event_type, ttl in ready:
            try:
                producer.publish(
                    body,
                    routing_key=key,
                    content_type=self.wire.content_type,
                    content_encoding="utf-8",
                    delivery_mode=2,
                    message_id=message_id,
                    type=event_type,
                    **({} if ttl is None else {"expiration": ttl / 1000}),
                )
            except ENCODING_ERRORS as exc:
                outcomes.append(undeliverable(exc))
                continue
            except lost as exc:  # the connection: every message waits for it
                self._drop()
                error = failure(
                    PublisherUnavailable, f"publish to {self.where} failed: {exc}", exc
                )
                return outcomes + [error] * (len(ready) - len(outcomes))
            except Exception as exc:  # about this message: an attempt
                outcomes.append(
                    failure(
                        DeliveryError,
                        f"{self.where} refused the message: "
                        f"{type(exc).__name__}: {exc}",
                        exc,
                    )
                )
                continue
            outcomes.append(None)
        return outcomes

    def _publish_confirmed(self, ready: list, flight: _InFlight) -> None:
        """Write the batch on the confirm-mode channel; its confirms are read
        by :meth:`_await` (this batch's, or a later one's). A message whose
        values cannot be encoded fails alone."""
        channel, raw = self._channel, self._raw
        transport = raw.transport
        frames = bytearray()
        written = []
        # The batch's frames are packed into one buffer (amqp_frames: a tenth
        # of py-amqp's per-message cost) and written with one system call.
        packer = self._frames
        try:
            for entry in ready:
                index, body, key, message_id, event_type, ttl = entry
                try:
                    packer.add(
                        frames,
                        key,
                        body,
                        message_id,
                        event_type,
                        None if ttl is None else str(ttl),
                    )
                except ENCODING_ERRORS as exc:
                    flight.outcomes[index] = undeliverable(exc)
                else:
                    written.append(entry)
        except BaseException:
            self._drop()
            raise
        flight.indexes = [entry[0] for entry in written]
        if not written:
            return
        confirms = _Confirms(
            self._next_tag,
            [entry[3] for entry in written],
            [len(entry[1]) for entry in written],
        )
        self._next_tag += len(written)
        channel.events["basic_ack"].add(confirms.on_ack)
        channel.events["basic_nack"].add(confirms.on_nack)
        channel.events["basic_return"].add(confirms.on_return)
        flight.confirms, flight.connection = confirms, raw
        flight.deadline = time.monotonic() + self.confirm_timeout
        try:
            with transport.having_timeout(self.confirm_timeout):
                transport.write(frames)
            raw.bytes_sent += 1  # as py-amqp counts a write (its heartbeats)
        except Exception as exc:
            self._drop()
            confirms.fail_waiting(self._lost(exc))
        except BaseException:
            self._drop()
            raise

    def _await(self, flight: _InFlight) -> None:
        """Read the broker's frames until ``flight``'s confirms are all in, its
        connection is gone, or its deadline passes."""
        confirms = flight.confirms
        while confirms.waiting:
            if flight.connection is not self._raw:
                # Dropped after this batch was written (a later batch lost the
                # connection, or found a message too large): its confirms
                # will never come.
                if flight.connection is self._refused:
                    flight.refused = True
                else:
                    confirms.fail_waiting(self._lost(None))
                return
            remaining = flight.deadline - time.monotonic()
            if remaining <= 0:
                self._drop()
                confirms.fail_waiting(
                    PublisherUnavailable(
                        f"no publisher confirm from {self.where} within "
                        f"{self.confirm_timeout:g} s (is the broker blocking "
                        "publishers on a memory or disk alarm?); the message may "
                        "or may not have reached a queue"
                    )
                )
                return
            try:
                with contextlib.suppress(TimeoutError):  # loop: check the deadline
                    self._raw.drain_events(timeout=remaining)
            except Exception as exc:
                too_large = self._too_large(exc)
                self._drop()
                if too_large:
                    flight.refused = True
                else:
                    confirms.fail_waiting(self._lost(exc))
                return
            except BaseException:
                self._drop()
                raise

    def _too_large(self, exc: BaseException) -> bool:
        """Whether ``exc`` is RabbitMQ closing the channel for a message over
        its ``max_message_size``; if so the limit is learned (:attr:`max_body`)
        and the batches written on this connection are to be sent again."""
        found = (
            _TOO_LARGE.search(str(exc))
            if isinstance(exc, amqp.exceptions.PreconditionFailed)
            else None
        )
        if found is None:
            return False
        limit = int(found[1])
        self.max_body = limit if self.max_body is None else min(self.max_body, limit)
        self._refused, self._refusal = self._raw, str(exc)
        return True

    def _send_again(self, flight: _InFlight) -> None:
        """Settle what ``flight`` still waits for after RabbitMQ closed its
        channel for a message too large: each message over the limit can
        never be sent; the others (which the broker discarded with the
        channel, or took without confirming) are sent again now, on a new
        connection (at least once)."""
        confirms = flight.confirms
        again = []
        for position, outcome in enumerate(confirms.outcomes):
            if outcome is not _PENDING:
                continue
            size = confirms.sizes[position]
            if position in confirms.returned:
                confirms.outcomes[position] = confirms.returned[position]
            elif size > self.max_body:
                confirms.outcomes[position] = UndeliverableMessage(
                    f"the message is {size} bytes; the broker closed the channel "
                    f"for it: {self._refusal}"
                )
            else:
                again.append(position)
        confirms.waiting = 0
        if again:
            messages = [flight.messages[flight.indexes[p]] for p in again]
            for position, result in zip(again, self.send_batch(messages), strict=True):
                confirms.outcomes[position] = result

    def _lost(self, exc: BaseException | None) -> PublisherUnavailable:
        reason = f": {exc}" if exc is not None else ""
        message = (
            f"the connection to {self.where} was lost before the broker "
            f"confirmed{reason}; the message may or may not have reached a queue"
        )
        return failure(PublisherUnavailable, message, exc)

    def _forget(self, confirms: _Confirms) -> None:
        """Stop crediting frames to ``confirms`` (its batch is settled)."""
        channel = self._channel
        if channel is None or not self.amqp:
            return
        channel.events["basic_ack"].discard(confirms.on_ack)
        channel.events["basic_nack"].discard(confirms.on_nack)
        channel.events["basic_return"].discard(confirms.on_return)


def _ttl(context: DeliveryContext) -> int | None:
    """Milliseconds until ``context`` expires (0 if it has), None for an event
    that does not: the AMQP ``expiration`` property (RabbitMQ's per-message
    TTL, "Time-To-Live and Expiration" in its documentation), counted by the
    outbox database's clock (:func:`~outbox_app.store.clock.database_now`), which the
    claim checked ``expires_at`` against."""
    if context.expires_at is None:
        return None
    left = (context.expires_at - database_now()).total_seconds()
    return max(0, math.ceil(left * 1000))


class _InFlight:
    """One batch handed to :meth:`KombuPublisher.send`: its outcomes so far,
    and for AMQP the confirms still to come."""

    def __init__(
        self, outcomes: list, indexes: list[int], messages: Sequence[DeliveryContext]
    ):
        self.outcomes = outcomes
        self.indexes = indexes  # positions of the messages that were published
        self.messages = messages
        self.confirms: _Confirms | None = None
        self.connection: Any = None
        self.deadline = 0.0
        #: RabbitMQ closed the channel for a message too large: what is not
        #: confirmed is settled by :meth:`KombuPublisher._send_again`.
        self.refused = False

    def settle(self, results: list[BaseException | None]) -> None:
        for index, result in zip(self.indexes, results, strict=True):
            self.outcomes[index] = result

    def settle_all(self, error: BaseException) -> None:
        self.settle([error] * len(self.indexes))

    def settle_pending(self, error: BaseException) -> None:
        for index, outcome in enumerate(self.outcomes):
            if outcome is _PENDING:
                self.outcomes[index] = error


class _Confirms:
    """The confirm state of one batch published on a confirm-mode channel.

    The broker numbers the messages of a channel 1, 2, 3, ... (delivery tags)
    and confirms each exactly once: ``basic.ack`` or ``basic.nack``, possibly
    ``multiple`` (every tag up to this one). A mandatory message no queue took
    first comes back as ``basic.return`` (identified by its ``message_id``),
    then is acked. RabbitMQ docs: https://www.rabbitmq.com/docs/confirms
    """

    def __init__(
        self, first_tag: int, message_ids: list[str], sizes: list[int] | None = None
    ):
        self.first = first_tag
        self.sizes = sizes or [0] * len(message_ids)  # body bytes
        self.outcomes: list[BaseException | None] = [_PENDING] * len(message_ids)
        self.returned: dict[int, DeliveryError] = {}
        self.by_id: dict[str, deque[int]] = defaultdict(deque)
        for index, message_id in enumerate(message_ids):
            self.by_id[message_id].append(index)
        self.waiting = len(message_ids)
        self.floor = 0  # every index below it is settled

    def on_ack(self, tag: int, multiple: bool) -> None:
        self._settle(tag, multiple, None)

    def on_nack(self, tag: int, multiple: bool) -> None:
        error = MessageRejected("the broker refused the message (basic.nack)")
        self._settle(tag, multiple, error)

    def on_return(self, exc, exchange: str, routing_key: str, message) -> None:
        indexes = self.by_id.get(message.properties.get("message_id"))
        if indexes:
            self.returned[indexes.popleft()] = MessageUnroutable(
                f"unroutable: no queue is bound to exchange {exchange!r} for "
                f"routing key {routing_key!r} (basic.return "
                f"{getattr(exc, 'reply_code', '')} {getattr(exc, 'reply_text', exc)})"
            )

    def _settle(self, tag: int, multiple: bool, error: DeliveryError | None) -> None:
        last = tag - self.first
        if not multiple and not 0 <= last < len(self.outcomes):
            return  # not a message of this batch
        last = min(last, len(self.outcomes) - 1)
        for index in range(self.floor if multiple else last, last + 1):
            if self.outcomes[index] is _PENDING:
                self.outcomes[index] = self.returned.get(index, error)
                self.waiting -= 1
        if multiple:
            self.floor = max(self.floor, last + 1)

    def fail_waiting(self, error: BaseException) -> None:
        for index, outcome in enumerate(self.outcomes):
            if outcome is _PENDING:
                self.outcomes[index] = self.returned.get(index, error)
        self.waiting = 0
