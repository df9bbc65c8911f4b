"""A publisher that records what it would send: :class:`RecordingPublisher`,
and :func:`record_publishers`, which puts it in place of the configured
publishers for a block and collects what they sent.

The relay runs a recording publisher as any other (fan-out, claims,
batches, retries, the delivery rows): only the last step differs. Its batch
is encoded in the entry's ``FORMAT`` (the bytes a broker would receive) and
kept in memory instead of being sent; every message counts as delivered.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from ..conf import outbox_settings
from ..exceptions import UnknownSubscriber
from ..publishers.base import Publisher, encode_each, wire_format
from ..subscribers import DeliveryContext

#: The ``BACKEND`` of a recording publisher.
RECORDING_BACKEND = "outbox_app.testing.RecordingPublisher"

_lock = threading.Lock()
#: The open record_publishers() blocks: each gets every message recorded.
_listening: list[SentMessages] = []


@dataclass(frozen=True)
class SentMessage:
    """One message a :class:`RecordingPublisher` would have sent.

    Attributes:
        publisher: the ``OUTBOX_PUBLISHERS`` entry's name.
        context: the delivery the relay handed to the publisher (its
            ``attempt``, ``delivery_id``, envelope and stored payload).
        body: the message body in the entry's ``FORMAT`` (CloudEvents JSON
            by default), the bytes a broker would receive.
        content_type: the body's content type.
    """

    publisher: str
    context: DeliveryContext
    body: bytes
    content_type: str

    @property
    def event_type(self) -> str:
        return self.context.event_type

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)

    @cached_property
    def event(self) -> Any:
        """The event rebuilt from the delivered payload, as a handler would
        receive it (an Event, or the payload dict for a type no class
        defines).

        Raises:
            EventDecodeError: the payload no longer fits its class.
        """
        from ..execution.run import event_for

        return event_for(self.context)


class SentMessages:
    """What the recording publishers sent while a :func:`record_publishers`
    block (or the ``outbox_publishers`` pytest fixture) was on, in the order
    they sent it. Iterable; ``len()`` counts every message."""

    def __init__(self) -> None:
        self._messages: list[SentMessage] = []
        self._lock = threading.Lock()

    def _add(self, messages: Sequence[SentMessage]) -> None:
        with self._lock:
            self._messages.extend(messages)

    @property
    def messages(self) -> list[SentMessage]:
        """Every message, in the order sent."""
        with self._lock:
            return list(self._messages)

    def to(self, publisher: str) -> list[SentMessage]:
        """The messages the entry named ``publisher`` sent."""
        return [m for m in self.messages if m.publisher == publisher]

    def clear(self) -> None:
        """Forget the messages recorded so far."""
        with self._lock:
            self._messages.clear()

    def __iter__(self) -> Iterator[SentMessage]:
        return iter(self.messages)

    def __len__(self) -> int:
        with self._lock:
            return len(self._messages)


class RecordingPublisher(Publisher):
    """A publisher that records instead of sending: the ``BACKEND``
    ``"outbox_app.testing.RecordingPublisher"``.

    Options: the common ones (``EVENT_TYPES``, ``ORDERED``, ``MAX_ATTEMPTS``,
    ``ALIASES``) and ``FORMAT`` (``"cloudevents"``, ``"corewrite"``,
    ``"debezium"``: the body it records); any other option (``URL``,
    ``EXCHANGE``, ...) is accepted and ignored, so a production entry can
    swap its ``BACKEND`` alone. Each message goes to every open
    :func:`record_publishers` block (none open: it is dropped, and still
    counts as delivered).

    Outcomes: delivered, or :class:`~outbox_app.exceptions.UndeliverableMessage`
    for a message its format cannot encode (the dead letter, as a broker
    publisher's).

    Raises:
        ImproperlyConfigured: malformed common options, an unknown ``FORMAT``.
    """

    def __init__(self, name: str, options: Mapping[str, Any]):
        super().__init__(name, options)
        self.wire = wire_format(name, options)

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        ready, refused = encode_each(messages, lambda c: (self.wire.body(c),))
        sent = [
            SentMessage(self.name, messages[index], body, self.wire.content_type)
            for index, body in ready
        ]
        with _lock:
            listening = list(_listening)
        for recorder in listening:
            recorder._add(sent)
        return [refused.get(index) for index in range(len(messages))]


@contextmanager
def record_publishers(*names: str) -> Iterator[SentMessages]:
    """Within the block, the ``OUTBOX_PUBLISHERS`` entries ``names`` (default:
    every entry but Celery's, whose ``enqueue()`` checks its ``BACKEND``)
    are :class:`RecordingPublisher` with their other options kept
    (``override_settings``); what they send is collected. Publishers built
    before are closed, so the relay builds the recording ones::

        with record_publishers() as sent:
            relay_once()
        [message] = sent.to("rabbitmq")

    Args:
        *names: entries to record; none: all but Celery's.

    Yields:
        The :class:`SentMessages`, readable after the block too.

    Raises:
        UnknownSubscriber: a name that is no ``OUTBOX_PUBLISHERS`` entry.
    """
    from django.test import override_settings

    from ..publishing.enqueue import TASK_BACKEND
    from ..relay.registry import close_publishers

    configured: dict[str, Mapping[str, Any]] = dict(outbox_settings.PUBLISHERS)
    unknown = [name for name in names if name not in configured]
    if unknown:
        raise UnknownSubscriber(
            f"record_publishers(): no OUTBOX_PUBLISHERS entry is named "
            f"{unknown[0]!r}; configured: {', '.join(configured) or 'none'}"
        )
    chosen = set(names) or {
        name
        for name, options in configured.items()
        if options.get("BACKEND") != TASK_BACKEND
    }
    recording = {
        name: {**options, "BACKEND": RECORDING_BACKEND} if name in chosen else options
        for name, options in configured.items()
    }
    sent = SentMessages()
    with override_settings(OUTBOX_PUBLISHERS=recording):
        close_publishers()
        with _lock:
            _listening.append(sent)
        try:
            yield sent
        finally:
            with _lock:
                _listening.remove(sent)
            close_publishers()
