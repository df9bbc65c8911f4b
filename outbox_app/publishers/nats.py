"""Publish events to NATS JetStream: exactly once into the stream within its
duplicate window.

JetStream stores each published message and answers with a PubAck; it drops a
message whose ``Nats-Msg-Id`` header it has already stored within the stream's
duplicate window (and still acks it, ``"duplicate": true``). Every message
carries the event id as ``Nats-Msg-Id``, so the one duplicate an outbox cannot
avoid (a relay that published and died before marking its rows, whose rows
another relay sends again after their lease) does not reach the stream twice.

A batch is pipelined like a RabbitMQ batch's confirms: :meth:`send` writes
every message of the batch, each with its own reply subject, and
:meth:`collect` waits for their PubAcks, so a batch costs about one round
trip. The client is the official ``nats-py`` (asyncio): each publisher runs one
event loop on a thread of its own for its lifetime and the relay's thread
hands it coroutines (``asyncio.run_coroutine_threadsafe``).

The PubAcks are read on a subscription of the publisher's own, not through
nats-py's ``JetStreamContext.publish_async``: that one never completes a
publish the server answered with an error (its reply callback raises instead,
nats-py 2.16), and a refused message would pass for a lost server.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import json
import logging
import re
import string
import threading
import time
from collections.abc import Coroutine, Mapping, Sequence
from typing import Any
from urllib.parse import quote

import nats
import nats.errors
from nats.js.errors import NotFoundError

from ..conf import mask_url, outbox_settings, positive_number
from ..exceptions import (
    DeliveryError,
    MessageRejected,
    MessageUnroutable,
    PublisherUnavailable,
)
from ..subscribers import DeliveryContext
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

DEFAULT_SUBJECT = "outbox.{event_type}"
OWN_OPTIONS = frozenset(
    {
        "URL",
        "STREAM",
        "SUBJECT",
        "ACK_TIMEOUT",
        "DECLARE",
        "STREAM_SUBJECTS",
        "DUPLICATE_WINDOW",
        "CONNECT_OPTIONS",
        "FORMAT",
    }
)
#: ``nats.connect`` arguments the publisher sets itself.
RESERVED_CONNECT_OPTIONS = frozenset(
    {
        "servers",
        "allow_reconnect",
        "max_reconnect_attempts",
        "reconnect_time_wait",
        "connect_timeout",
        "error_cb",
        "disconnected_cb",
        "closed_cb",
        "reconnected_cb",
    }
)
MSG_ID = "Nats-Msg-Id"
EXPECTED_STREAM = "Nats-Expected-Stream"
#: JetStream's error code for a subject stored by another stream than the
#: expected one.
WRONG_STREAM = 10060
#: Stream names: no whitespace, ``.``, ``*``, ``>``, ``/`` or ``\``.
STREAM_NAME = re.compile(r"[^\s.*>/\\]+")
#: A subject token one can publish to: not empty, no whitespace, no wildcard.
SUBJECT_TOKEN = re.compile(r"[^\s]+")

logger = logging.getLogger("outbox_app.relay")

_NO_STREAM: Any = object()  # "no responders": resolved per batch in _collect


class JetStreamPublisher(Publisher):
    """A publisher to one NATS JetStream stream.

    Options (besides the common ones of :class:`~outbox_app.publishers.base.Publisher`):

    ``URL`` (required)
        ``nats://host:4222`` (credentials as ``nats://user:password@host:4222``),
        or a list of server URLs of one cluster.
    ``STREAM`` (required)
        The stream the messages must be stored in: each is published with
        ``Nats-Expected-Stream`` set to it.
    ``SUBJECT`` (default ``"outbox.{event_type}"``)
        :meth:`str.format` template over the
        :class:`~outbox_app.subscribers.DeliveryContext` fields, as
        ``KombuPublisher``'s ``ROUTING_KEY``; a ``None`` field formats as ``""``.
        Subjects of a model label hold its dot: ``{aggregate_type}`` of
        ``shop.Order`` is two tokens.
    ``ACK_TIMEOUT`` (default ``10``)
        Seconds to wait for a batch's PubAcks from its publish, and for the
        connection to open.
    ``DECLARE`` (default ``False``)
        Create the stream, or update it, when the connection opens: it then
        captures ``STREAM_SUBJECTS`` (added to the ones it has) with a
        duplicate window of ``DUPLICATE_WINDOW``; its other settings are
        JetStream's defaults (file storage, limits retention, one replica) or
        left as they are.
    ``STREAM_SUBJECTS`` (with ``DECLARE``; default derived from ``SUBJECT``)
        The subjects the declared stream captures: by default ``SUBJECT``'s
        fixed leading tokens followed by ``>`` (``["outbox.>"]`` for the
        default); required when ``SUBJECT`` starts with a field.
    ``DUPLICATE_WINDOW`` (with ``DECLARE``; default ``120``)
        Seconds within which the declared stream drops a message whose
        ``Nats-Msg-Id`` it has stored. Keep it above ``OUTBOX_LEASE_SECONDS``:
        a batch a crashed relay sent is sent again by the relay that takes
        its rows over once the lease has run out. ``manage.py check`` warns
        (``outbox.W005``) when a declared window is not longer, and the
        publisher logs a warning once when it connects to a stream whose
        window is not.
    ``FORMAT`` (default ``"cloudevents"``)
        The body, as ``KombuPublisher``'s: ``cloudevents`` or ``corewrite``
        (its content type in the ``Content-Type`` header).
    ``CONNECT_OPTIONS`` (default ``{}``)
        Passed to ``nats.connect`` (``user_credentials``, ``tls``, ``token``,
        ``name``, ...); the reconnect and callback arguments are the
        publisher's own.

    Behaviour: each message is the event in its ``FORMAT`` (by default the
    CloudEvents JSON envelope, :func:`~outbox_app.publishers.cloudevents.body`)
    with the headers ``Content-Type`` (``application/cloudevents+json`` by
    default), ``Nats-Msg-Id`` =
    ``<namespace>:<publisher name>:<event id>`` (:func:`message_id`) and
    ``Nats-Expected-Stream`` = ``STREAM``. A message is reported
    delivered once its PubAck arrives, a duplicate's included (the stream
    holds it). A message JetStream refuses (a stream limit, say) fails with
    :class:`~outbox_app.exceptions.MessageRejected`; one whose subject no
    stream captures, or another stream than ``STREAM`` does, with
    :class:`~outbox_app.exceptions.MessageUnroutable` (both attempts, retried
    with backoff); one that cannot be encoded (an invalid subject, a field
    the template needs is missing, larger than the server's max payload) with
    :class:`~outbox_app.exceptions.UndeliverableMessage` (it goes to the dead letter at
    once). A server that cannot be reached, a connection lost before the
    PubAcks, the ack timeout, or ``STREAM`` missing,
    fail the messages with :class:`~outbox_app.exceptions.PublisherUnavailable`
    (the relay pauses the publisher, counts no attempt, and resumes once
    :meth:`probe` finds the stream). After a connection error or timeout the
    connection is dropped; the next batch, or :meth:`probe`, reconnects.

    One instance is used by one thread at a time: ``registry.publishers()``
    builds one per thread; each instance has its own event loop thread,
    started with its first batch and ended by :meth:`close`.

    Raises:
        ImproperlyConfigured: a missing ``URL`` or ``STREAM``, or a malformed
            or unknown option.
    """

    def __init__(self, name: str, options: Mapping[str, Any]):
        super().__init__(name, options)
        unknown = set(options) - COMMON_OPTIONS - OWN_OPTIONS
        if unknown:
            raise config_error(name, f"unknown option(s) {sorted(unknown)}")
        url = options.get("URL")
        servers = [url] if isinstance(url, str) else url
        if not (
            isinstance(servers, list | tuple)
            and servers
            and all(isinstance(s, str) and s for s in servers)
        ):
            raise config_error(
                name,
                "'URL' is required, e.g. 'nats://127.0.0.1:4222', got "
                + mask_url(repr(url)),
            )
        stream = options.get("STREAM")
        if not isinstance(stream, str) or not STREAM_NAME.fullmatch(stream):
            raise config_error(
                name,
                "'STREAM' is required: a stream name without whitespace, '.', "
                f"'*', '>', '/' or '\\', got {stream!r}",
            )
        declare = options.get("DECLARE", False)
        if not isinstance(declare, bool):
            raise config_error(name, f"'DECLARE' must be True or False: {declare!r}")
        if not declare:
            given = sorted({"STREAM_SUBJECTS", "DUPLICATE_WINDOW"} & set(options))
            if given:
                raise config_error(
                    name,
                    f"{given} only apply with 'DECLARE': True (a stream the "
                    "publisher does not declare keeps its own settings)",
                )
        connect_options = options.get("CONNECT_OPTIONS", {})
        if not isinstance(connect_options, Mapping):
            raise config_error(name, "'CONNECT_OPTIONS' must be a dict")
        reserved = sorted(RESERVED_CONNECT_OPTIONS & set(connect_options))
        if reserved:
            raise config_error(
                name, f"'CONNECT_OPTIONS' may not set {reserved}: the publisher does"
            )

        self.servers = list(servers)
        self.where = ", ".join(map(mask_url, self.servers))  # for messages
        self.stream = stream
        self.wire = wire_format(name, options)
        self.subject = options.get("SUBJECT", DEFAULT_SUBJECT)
        self._subject_fields = template_fields(name, "SUBJECT", self.subject)
        self.ack_timeout = _seconds(name, options, "ACK_TIMEOUT", 10)
        self.declare = declare
        self.duplicate_window = _seconds(name, options, "DUPLICATE_WINDOW", 120)
        subjects = options.get("STREAM_SUBJECTS", _stream_subjects(self.subject))
        if declare and subjects is None:
            raise config_error(
                name,
                f"'STREAM_SUBJECTS' is required with 'DECLARE': 'SUBJECT' "
                f"{self.subject!r} starts with a field, so the subjects the stream "
                "captures cannot be derived from it",
            )
        if subjects is not None and (
            isinstance(subjects, str)
            or not subjects
            or not all(isinstance(s, str) and s for s in subjects)
        ):
            raise config_error(
                name, f"'STREAM_SUBJECTS' must be a list of subjects: {subjects!r}"
            )
        self.stream_subjects = None if subjects is None else list(subjects)
        self.connect_options = dict(connect_options)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._link: _Link | None = None  # the open connection (loop thread only)
        self._warned = False  # a short duplicate window was logged

    # --- the interface --------------------------------------------------------

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        """Publish ``messages`` and wait for their PubAcks; ``None`` for each
        one the stream stored (:meth:`send`, then :meth:`collect`)."""
        return self.collect(self.send(messages))

    def send(self, messages: Sequence[DeliveryContext]) -> _InFlight:
        """Publish ``messages`` without waiting for their PubAcks.

        Messages that cannot be encoded get
        :class:`~outbox_app.exceptions.UndeliverableMessage` at once; when the
        server cannot be reached, the others get
        :class:`~outbox_app.exceptions.PublisherUnavailable`. Never raises for
        a message or the server.
        """
        flight = _InFlight(len(messages), time.monotonic() + self.ack_timeout)
        ready, refused = encode_each(messages, self._encode)  # (index, subject, ...)
        for index, error in refused.items():
            flight.outcomes[index] = error
        for index, subject, _, _ in ready:
            flight.subjects[index] = subject
        if ready:
            self._call(self._publish(ready, flight), flight.outcomes)
        return flight

    def collect(self, sent: _InFlight) -> list[BaseException | None]:
        """Wait (at most ``ACK_TIMEOUT`` from the publish) for the PubAcks of
        what :meth:`send` published; one outcome per message, in order."""
        if any(isinstance(o, asyncio.Future) for o in sent.outcomes):
            self._call(self._collect(sent), sent.outcomes)
        return sent.outcomes

    def probe(self) -> None:
        """Connect (declaring the stream with ``DECLARE``) and look the stream
        up.

        Raises:
            PublisherUnavailable: the server cannot be reached, or ``STREAM``
                does not exist.
        """
        failed: list[Any] = [None]
        self._call(self._probe(failed), failed)
        if failed[0] is not None:
            raise failed[0]

    def close(self) -> None:
        """Close the connection and end the event loop thread (bounded by
        ``ACK_TIMEOUT``)."""
        loop, thread = self._loop, self._thread
        if loop is None:
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown(), [None])
        loop.call_soon_threadsafe(loop.stop)
        thread.join(self.ack_timeout)
        if not thread.is_alive():
            loop.close()
        self._loop = self._thread = None

    # --- encoding -------------------------------------------------------------

    def _encode(self, context: DeliveryContext) -> tuple[str, bytes, dict[str, str]]:
        subject = render(self.subject, self._subject_fields, context, self.wire)
        tokens = subject.split(".")
        if not all(SUBJECT_TOKEN.fullmatch(t) and t not in "*>" for t in tokens):
            raise ValueError(
                f"{subject!r} is not a subject to publish to (an empty token, "
                "whitespace or a wildcard)"
            )
        headers = {
            "Content-Type": self.wire.content_type,
            MSG_ID: message_id(context.namespace, self.name, context.event_id),
            EXPECTED_STREAM: self.stream,
        }
        return subject, self.wire.body(context), headers

    # --- the event loop thread ------------------------------------------------

    def _call(self, coroutine: Coroutine, outcomes: list) -> None:
        """Run ``coroutine`` on the publisher's loop; if it does not finish
        within a bound (it bounds its own waits), every outcome still open in
        ``outcomes`` becomes PublisherUnavailable."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever,
                name=f"outbox-nats-{self.name}",
                daemon=True,
            )
            self._thread.start()
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            future.result(2 * self.ack_timeout + 5)
        except concurrent.futures.TimeoutError as exc:
            future.cancel()
            error = failure(
                PublisherUnavailable,
                f"no answer from {self.where} within {2 * self.ack_timeout + 5:g} s",
                exc,
            )
            for index, outcome in enumerate(outcomes):
                if outcome is None or isinstance(outcome, asyncio.Future):
                    outcomes[index] = error

    # --- on the loop ----------------------------------------------------------

    async def _connect(self) -> _Link:
        """The open connection; opens it (and declares the stream) if needed.
        Raises what nats-py raises."""
        link = self._link
        if link is not None and link.nc.is_connected:
            return link
        await self._drop()
        link = _Link(self)
        link.nc = nats.NATS()
        try:
            await link.nc.connect(
                servers=self.servers,
                # No reconnect inside nats-py: replies to messages written
                # before a reconnect would never come. A lost connection fails
                # the batch (the relay pauses) and the next batch or probe
                # opens a new one.
                allow_reconnect=False,
                max_reconnect_attempts=1,  # nats-py: 0 would try forever
                reconnect_time_wait=0.2,
                connect_timeout=self.ack_timeout,
                error_cb=link.on_error,
                closed_cb=link.closed,
                **self.connect_options,
            )
        except BaseException as exc:
            # nats-py leaves the socket of a failed handshake open.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.nc.close(), 1)
            if not isinstance(exc, nats.errors.NoServersError) or link.error is None:
                raise
            raise link.error from exc  # why: refused, unknown host, auth
        self._link = link
        try:
            link.inbox = link.nc.new_inbox() + "."
            await link.nc.subscribe(link.inbox + "*", cb=link.on_reply)
            window = await self._stream(link)
        except BaseException:
            await self._drop()
            raise
        short = _short_window(window)
        if short and not self._warned:
            self._warned = True
            logger.warning("publisher %s: %s", self.name, short)
        return link

    async def _stream(self, link: _Link) -> float | None:
        """Declare the stream if asked (``DECLARE``); its duplicate window in
        seconds, None while it does not exist."""
        js = link.nc.jetstream(timeout=self.ack_timeout)
        try:
            info = await js.stream_info(self.stream)
        except NotFoundError:
            if not self.declare:
                return None  # each batch pauses the publisher until it exists
            await js.add_stream(
                name=self.stream,
                subjects=self.stream_subjects,
                duplicate_window=self.duplicate_window,
            )
            return self.duplicate_window
        config = info.config
        if not self.declare:
            return config.duplicate_window
        have = config.subjects or []
        missing = [s for s in self.stream_subjects if s not in have]
        if missing or config.duplicate_window != self.duplicate_window:
            await js.update_stream(
                config.evolve(
                    subjects=[*have, *missing], duplicate_window=self.duplicate_window
                )
            )
        return self.duplicate_window

    def warnings(self) -> list[str]:
        short = _short_window(self.duplicate_window) if self.declare else None
        return [short] if short else []

    async def _drop(self) -> None:
        """Close the connection, failing what still waits for a PubAck."""
        link, self._link = self._link, None
        if link is not None:
            link.fail_waiting(self._lost(None))
            with contextlib.suppress(Exception):
                await asyncio.wait_for(link.nc.close(), 1)

    async def _shutdown(self) -> None:
        """Close the connection and end what nats-py left running, as
        ``asyncio.run`` does before it closes its loop."""
        await self._drop()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0)  # the transports' connection_lost callbacks

    async def _publish(self, ready: list, flight: _InFlight) -> None:
        outcomes = flight.outcomes
        try:
            link = await self._connect()
        except Exception as exc:
            error = failure(
                PublisherUnavailable, f"cannot connect to {self.where}: {exc}", exc
            )
            for index, *_ in ready:
                outcomes[index] = error
            return
        for position, (index, subject, body, headers) in enumerate(ready):
            try:
                outcomes[index] = await link.publish(subject, body, headers)
            except nats.errors.MaxPayloadError as exc:
                outcomes[index] = undeliverable(exc)
            except Exception as exc:  # the connection is gone
                await self._drop()
                error = self._lost(exc)
                for later, *_ in ready[position:]:
                    outcomes[later] = error
                return

    async def _collect(self, flight: _InFlight) -> None:
        outcomes = flight.outcomes
        waiting = [o for o in outcomes if isinstance(o, asyncio.Future)]
        remaining = flight.deadline - time.monotonic()
        _, late = await asyncio.wait(waiting, timeout=max(remaining, 0))
        if late:
            timeout = PublisherUnavailable(
                f"no PubAck from {self.where} within {self.ack_timeout:g} s; the "
                "message may or may not be in the stream (sent again within the "
                "stream's duplicate window, it is stored once)"
            )
            for future in late:
                future.set_result(timeout)
            await self._drop()
        results = [o.result() if isinstance(o, asyncio.Future) else o for o in outcomes]
        if any(r is _NO_STREAM for r in results):
            unrouted = await self._unrouted(set(flight.subjects.values()))
            results = [
                unrouted[flight.subjects[i]] if r is _NO_STREAM else r
                for i, r in enumerate(results)
            ]
        outcomes[:] = results

    async def _unrouted(self, subjects: set[str]) -> dict[str, DeliveryError]:
        """The outcome of a message no stream answered for, by subject: the
        stream is missing (PublisherUnavailable), or it does not capture the
        subject (MessageUnroutable)."""
        try:
            link = await self._connect()
            info = await link.nc.jetstream(timeout=self.ack_timeout).stream_info(
                self.stream
            )
        except NotFoundError as exc:
            missing = failure(
                PublisherUnavailable,
                f"JetStream stream {self.stream!r} does not exist on {self.where}; "
                "create it (or set 'DECLARE': True)",
                exc,
            )
            return dict.fromkeys(subjects, missing)
        except Exception as exc:
            down = failure(
                PublisherUnavailable,
                f"no JetStream stream answers on {self.where}: {exc}",
                exc,
            )
            return dict.fromkeys(subjects, down)
        captured = info.config.subjects
        return {
            subject: MessageUnroutable(
                f"unroutable: JetStream stream {self.stream!r} (subjects "
                f"{captured}) does not capture subject {subject!r}, and no stream "
                "answered for it"
            )
            for subject in subjects
        }

    async def _probe(self, failed: list) -> None:
        try:
            link = await self._connect()
            await link.nc.jetstream(timeout=self.ack_timeout).stream_info(self.stream)
        except NotFoundError as exc:
            failed[0] = failure(
                PublisherUnavailable,
                f"JetStream stream {self.stream!r} does not exist on {self.where}",
                exc,
            )
        except Exception as exc:
            await self._drop()
            failed[0] = failure(
                PublisherUnavailable, f"cannot reach {self.where}: {exc}", exc
            )

    def _lost(self, exc: BaseException | None) -> PublisherUnavailable:
        reason = f": {exc}" if exc is not None else ""
        return failure(
            PublisherUnavailable,
            f"the connection to {self.where} was lost before the server "
            f"acknowledged{reason}; the message may or may not be in the stream "
            "(sent again within the stream's duplicate window, it is stored once)",
            exc,
        )

    def _judge(self, msg: Any, subject: str) -> BaseException | None:
        """The outcome of one message from JetStream's reply ``msg``."""
        if msg.headers and msg.headers.get("Status") == "503":
            return _NO_STREAM  # no responders: no stream captures the subject
        try:
            error = json.loads(msg.data).get("error")
        except (ValueError, AttributeError) as exc:
            return failure(
                MessageRejected, f"unreadable PubAck {msg.data[:200]!r}", exc
            )
        if error is None:
            return None  # a PubAck; "duplicate": true too (the stream holds it)
        description = error.get("description", error)
        if error.get("err_code") == WRONG_STREAM:
            return MessageUnroutable(
                f"unroutable: subject {subject!r} is captured by another stream "
                f"than {self.stream!r} (JetStream: {description})"
            )
        return MessageRejected(
            f"JetStream refused the message: {description} "
            f"(code {error.get('code')}, error {error.get('err_code')})"
        )


class _InFlight:
    """One batch handed to :meth:`JetStreamPublisher.send`: per message its
    outcome, or the future of its PubAck (settled on the loop)."""

    def __init__(self, size: int, deadline: float):
        self.outcomes: list[Any] = [None] * size
        self.deadline = deadline
        self.subjects: dict[int, str] = {}  # by index, for unroutable messages


class _Link:
    """One open connection: the reply subject its PubAcks come back on, and
    the messages waiting for one, by reply token. Used on the loop only."""

    def __init__(self, publisher: JetStreamPublisher):
        self.publisher = publisher
        self.nc: Any = None
        self.inbox = ""
        self.error: Exception | None = None  # nats-py's last one
        self.tokens = itertools.count()
        self.waiting: dict[str, tuple[asyncio.Future, str]] = {}

    async def publish(self, subject: str, body: bytes, headers: dict) -> asyncio.Future:
        token = str(next(self.tokens))
        future = asyncio.get_running_loop().create_future()
        self.waiting[token] = (future, subject)
        try:
            await self.nc.publish(
                subject, body, reply=self.inbox + token, headers=headers
            )
        except BaseException:
            del self.waiting[token]
            raise
        return future

    async def on_reply(self, msg: Any) -> None:
        entry = self.waiting.pop(msg.subject[len(self.inbox) :], None)
        if entry is not None and not entry[0].done():
            entry[0].set_result(self.publisher._judge(msg, entry[1]))

    async def on_error(self, error: Exception) -> None:
        """nats-py's error callback: remembered for the connect error's
        message; the errors of a batch reach its outcomes (nats-py's default
        logs each one with a traceback)."""
        self.error = error

    async def closed(self) -> None:
        if self.publisher._link is self:
            self.publisher._link = None
        self.fail_waiting(self.publisher._lost(self.nc.last_error))

    def fail_waiting(self, error: BaseException) -> None:
        waiting, self.waiting = self.waiting, {}
        for future, _ in waiting.values():
            if not future.done():
                future.set_result(error)


def message_id(namespace: str, publisher: str, event_id: Any) -> str:
    """The ``Nats-Msg-Id`` of an event: ``<namespace>:<publisher>:<event id>``,
    ``%`` and ``:`` in the namespace and the publisher name percent-encoded
    (so two pairs never spell the same id). Unique per project
    (``OUTBOX_NAMESPACE``, the CloudEvents ``source``), publisher entry and
    event: a stream drops a resend of the same publisher only."""
    quoted = (quote(part, safe="") for part in (namespace, publisher))
    return f"{':'.join(quoted)}:{event_id}"


def _short_window(window: float | None) -> str | None:
    """Why a stream's duplicate window (seconds) is too short to drop a batch
    resent after a relay crashed between the PubAcks and marking its rows, or
    None when it is long enough (or unknown)."""
    lease = outbox_settings.LEASE_SECONDS
    if window is None or window > lease:
        return None
    return (
        f"the stream's duplicate window ({window:g} s) is not longer than "
        f"OUTBOX_LEASE_SECONDS ({lease:g} s): a batch a crashed relay sent is "
        "sent again once its lease runs out, and then stored twice"
    )


def _seconds(name: str, options: Mapping[str, Any], option: str, default: float):
    value = options.get(option, default)
    if not positive_number(value):
        raise config_error(
            name, f"{option!r} must be a positive number of seconds, got {value!r}"
        )
    return float(value)


def _stream_subjects(template: str) -> list[str] | None:
    """The subjects a stream captures to take every subject of ``template``:
    its fixed leading tokens and ``>``; None when it starts with a field."""
    parts = list(string.Formatter().parse(template))
    literal, field = parts[0][0], parts[0][1]
    if len(parts) == 1 and field is None:
        return [template]  # a fixed subject
    prefix = literal.rpartition(".")[0]
    return [f"{prefix}.>"] if prefix else None
