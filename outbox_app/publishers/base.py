"""The publisher interface: a subscriber that sends events to a destination.

A publisher is configured as one ``OUTBOX_PUBLISHERS`` entry::

    OUTBOX_PUBLISHERS = {
        "rabbitmq": {
            "BACKEND": "outbox_app.publishers.kombu.KombuPublisher",  # default
            "EVENT_TYPES": ["*"],        # or a list of event types
            "ORDERED": False,            # per-aggregate order
            "MAX_ATTEMPTS": None,        # None: OUTBOX_MAX_ATTEMPTS
            ...                          # the backend's own options
        }
    }

It is a subscriber of the delivery engine like a handler, so it gets
deliveries, retries, backoff, expiry, ordering and requeue for free. A backend
implements :meth:`Publisher.send_batch`; one that can keep several batches on
the wire (publisher confirms) also implements :meth:`Publisher.send` and
:meth:`Publisher.collect`, and one that can check its destination cheaply
implements :meth:`Publisher.probe`.

Outcomes: ``None`` (delivered), :class:`~outbox_app.exceptions.PublisherUnavailable`
(the destination is down: the relay pauses the publisher and counts no
attempt), :class:`~outbox_app.exceptions.UndeliverableMessage` (this message
can never be sent: it goes to the dead letter at once), any other exception
(this message failed: retried with backoff, one attempt counted).
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string

from ..events.codec import dumps
from ..exceptions import DeliveryError, UndeliverableMessage
from ..subscribers import (
    WILDCARD,
    DeliveryContext,
    Kind,
    Subscriber,
    check_stream_options,
)
from . import cloudevents, corewrite

DEFAULT_BACKEND = "outbox_app.publishers.kombu.KombuPublisher"


@dataclass(frozen=True)
class WireFormat:
    """How a publisher writes an event: a ``FORMAT`` option's value."""

    #: The message's content type.
    content_type: str
    #: The message body of a delivery (raises ValueError, TypeError for one
    #: that cannot be encoded).
    body: Callable[[DeliveryContext], bytes]
    #: What ``{operation}`` in a destination template spells for an event's
    #: operation (None: no operation).
    operation: Callable[[str | None], str | None]
    #: The routing key or subject template a publisher of this format uses
    #: when its options name none (None: the publisher's own default).
    default_key: str | None = None


def _payload_body(context: DeliveryContext) -> bytes:
    """The payload alone, as compact UTF-8 JSON: the value Debezium's outbox
    event router sends (its event id and type go in the message's headers
    or properties)."""
    if not context.event_type:
        raise ValueError(f"outbox event {context.event_id} has no event type")
    return dumps(context.payload)


#: ``FORMAT`` -> the wire format: CloudEvents 1.0 structured mode (the
#: default; ``publishers/cloudevents.py``), the CoreWrite JSON object
#: (``publishers/corewrite.py``), or the payload alone as Debezium's outbox
#: event router sends it (``debezium``).
FORMATS = {
    "cloudevents": WireFormat(
        cloudevents.CONTENT_TYPE, cloudevents.body, lambda operation: operation
    ),
    "corewrite": WireFormat(
        corewrite.CONTENT_TYPE,
        corewrite.body,
        lambda operation: corewrite.operation(operation).lower(),
        "{dimension}.{operation}",
    ),
    "debezium": WireFormat(
        corewrite.CONTENT_TYPE, _payload_body, lambda operation: operation
    ),
}


def wire_format(name: str, options: Mapping[str, Any]) -> WireFormat:
    """The wire format the ``FORMAT`` option of ``OUTBOX_PUBLISHERS[name]``
    names (default ``"cloudevents"``).

    Raises:
        ImproperlyConfigured: a name that is not in :data:`FORMATS`.
    """
    chosen = options.get("FORMAT", "cloudevents")
    if chosen not in FORMATS:
        raise config_error(
            name, f"'FORMAT' must be one of {sorted(FORMATS)}, got {chosen!r}"
        )
    return FORMATS[chosen]


#: Options every publisher understands; a backend adds its own.
COMMON_OPTIONS = frozenset(
    {
        "BACKEND",
        "EVENT_TYPES",
        "ORDERED",
        "MAX_ATTEMPTS",
        "ALIASES",
        "START",
        "PARTITIONS",
    }
)
#: Names a destination template may use beside the context's fields, each
#: computed from the context: ``{dimension}`` is the aggregate type lower-cased
#: (``product`` for ``@track(aggregate_type="Product")``), as routing keys
#: such as ``product.update`` spell it.
DERIVED_FIELDS = {
    "dimension": lambda context: (context.aggregate_type or "").lower(),
}
#: The names a destination template (a routing key, a subject) may use.
CONTEXT_FIELDS = frozenset(f.name for f in fields(DeliveryContext)) | frozenset(
    DERIVED_FIELDS
)


class Publisher(Subscriber):
    """Base class of broker destinations.

    Args:
        name: the ``OUTBOX_PUBLISHERS`` key; the subscriber name on its rows.
        options: the entry's options. Common keys: ``EVENT_TYPES`` (list of types
            or ``["*"]``, default ``["*"]``), ``ORDERED`` (bool), ``MAX_ATTEMPTS``
            (int or None), ``ALIASES`` (former names), ``START`` (``"now"`` or
            ``"earliest"``: where stream delivery starts for a new publisher),
            ``PARTITIONS`` (stream delivery's partitions; default
            ``OUTBOX_PARTITIONS``).

    Raises:
        ImproperlyConfigured: malformed common options.
    """

    kind: ClassVar[Kind] = "publisher"

    def __init__(self, name: str, options: Mapping[str, Any]):
        event_types = options.get("EVENT_TYPES", [WILDCARD])
        if isinstance(event_types, str) or not all(
            isinstance(t, str) for t in event_types
        ):
            raise ImproperlyConfigured(
                f"OUTBOX_PUBLISHERS[{name!r}]['EVENT_TYPES'] must be a list of event "
                f"types or ['*'], got {event_types!r}"
            )
        super().__init__(
            name=name,
            event_types=None if WILDCARD in event_types else frozenset(event_types),
            ordered=bool(options.get("ORDERED", False)),
            max_attempts=options.get("MAX_ATTEMPTS"),
            # A message the destination can never take is dead at once.
            give_up_on=(UndeliverableMessage,),
            aliases=tuple(options.get("ALIASES", ())),
            start=options.get("START", "now"),
            partitions=options.get("PARTITIONS"),
        )
        check_stream_options(
            f"OUTBOX_PUBLISHERS[{name!r}]", self.start, self.partitions
        )
        self.options = dict(options)

    def send_batch(
        self, messages: Sequence[DeliveryContext]
    ) -> list[BaseException | None]:
        """Deliver ``messages``; report one outcome per message, in order.

        ``None`` means delivered: the destination confirmed it (for RabbitMQ, a
        publisher confirm). An exception instance means not delivered; its text
        is recorded on the delivery and, unless it is
        :class:`~outbox_app.exceptions.PublisherUnavailable` or
        :class:`~outbox_app.exceptions.UndeliverableMessage` (see the module
        docstring), the message is retried with backoff. A backend may also
        raise: every message of the batch then has that outcome (an
        ``OSError``, a refused or reset connection, counts as
        ``PublisherUnavailable``).
        """
        raise NotImplementedError

    def send(self, messages: Sequence[DeliveryContext]) -> Any:
        """Put ``messages`` on the wire and return a handle for :meth:`collect`,
        without waiting for the destination to confirm them.

        The relay sends batch N+1 before it collects batch N, so one batch is
        on the wire while the previous one's confirms arrive and its rows are
        marked (a confirm window across batches). The default sends and waits
        at once (:meth:`send_batch`); a backend with asynchronous confirms
        overrides both methods. Raises as :meth:`send_batch` does.
        """
        return self.send_batch(messages)

    def collect(self, sent: Any) -> list[BaseException | None]:
        """Wait for the outcomes of what :meth:`send` returned ``sent`` for:
        one per message, in order, as :meth:`send_batch` reports them."""
        return sent

    def probe(self) -> None:
        """Check that the destination is reachable again after an outage (the
        relay calls it before resuming a paused publisher).

        The default does nothing: the next batch is the probe. Raises any
        exception when the destination is still down.
        """

    def close(self) -> None:
        """Release connections. The relay calls it on shutdown."""

    def missing_packages(self) -> list[str]:
        """The ``pip install`` arguments of what this publisher needs to send
        and cannot import (``"'outbox_app[kafka]'"``); ``manage.py check``
        warns of each as ``outbox.W007``. The default: none."""
        return []

    def warnings(self) -> list[str]:
        """What in this configuration works but risks a guarantee, one
        sentence each; ``manage.py check`` reports them as ``outbox.W005``.
        The default has none."""
        return []


def build_publisher(name: str, options: Mapping[str, Any]) -> Publisher:
    """Build the publisher for one ``OUTBOX_PUBLISHERS`` entry.

    Raises:
        ImproperlyConfigured: the ``BACKEND`` cannot be imported, is not a
            Publisher, or rejects the options.
    """
    path = options.get("BACKEND", DEFAULT_BACKEND)
    try:
        cls = import_string(path)
    except ImportError as exc:
        raise ImproperlyConfigured(
            f"OUTBOX_PUBLISHERS[{name!r}]: cannot import BACKEND {path!r}: {exc}"
        ) from exc
    if not (isinstance(cls, type) and issubclass(cls, Publisher)):
        raise ImproperlyConfigured(
            f"OUTBOX_PUBLISHERS[{name!r}]: {path} is not a Publisher subclass"
        )
    return cls(name, options)


# --- for backends: option errors, destination templates, outcomes ---------------


def config_error(name: str, problem: str) -> ImproperlyConfigured:
    """The error for a malformed option of the ``OUTBOX_PUBLISHERS[name]`` entry."""
    return ImproperlyConfigured(f"OUTBOX_PUBLISHERS[{name!r}]: {problem}")


def template_fields(name: str, option: str, template: Any) -> frozenset[str]:
    """The :class:`~outbox_app.subscribers.DeliveryContext` fields the
    :meth:`str.format` template ``template`` (the value of ``option``, a
    routing key or a subject) uses: ``{event_type}``, ``{headers[kind]}``, ...

    Raises:
        ImproperlyConfigured: not a string, malformed, positional fields, or a
            field DeliveryContext does not have.
    """
    if not isinstance(template, str):
        raise config_error(name, f"{option!r} must be a format string: {template!r}")
    try:
        used = {
            re.split(r"[.\[]", field)[0]
            for _, field, _, _ in string.Formatter().parse(template)
            if field is not None
        }
    except ValueError as exc:
        raise config_error(name, f"{option!r} {template!r}: {exc}") from exc
    if any(field == "" or field.isdigit() for field in used):
        raise config_error(
            name, f"{option!r} {template!r}: positional fields; name them"
        )
    unknown = used - CONTEXT_FIELDS
    if unknown:
        raise config_error(
            name,
            f"{option!r} {template!r} uses unknown field(s) {sorted(unknown)}; "
            f"known: {sorted(CONTEXT_FIELDS)}",
        )
    return frozenset(used)


def render(
    template: str,
    used: frozenset[str],
    context: DeliveryContext,
    wire: WireFormat = FORMATS["cloudevents"],
) -> str:
    """``template`` formatted with ``context``'s fields ``used`` (as
    :func:`template_fields` found them, :data:`DERIVED_FIELDS` included), the
    operation as the ``wire`` format spells it; a ``None`` field formats as
    ``""``.

    Raises:
        KeyError, IndexError, AttributeError: an item or attribute the template
            names is missing (``{headers[kind]}`` without a ``kind`` header).
    """
    values = {}
    for field in used:
        derived = DERIVED_FIELDS.get(field)
        value = derived(context) if derived else getattr(context, field)
        if field == "operation":
            value = wire.operation(value)
        values[field] = "" if value is None else value
    return template.format_map(values)


def encode_each(
    messages: Sequence[DeliveryContext], encode: Any
) -> tuple[list[tuple], dict[int, UndeliverableMessage]]:
    """``encode(context)`` (a tuple) of each message: ``(index, *encoded)`` of
    the messages that could be encoded, in order, and the
    :class:`~outbox_app.exceptions.UndeliverableMessage` of the others (a
    template field missing, a payload that is not JSON, ...) by index."""
    ready: list[tuple] = []
    refused: dict[int, UndeliverableMessage] = {}
    for index, context in enumerate(messages):
        try:
            ready.append((index, *encode(context)))
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            refused[index] = undeliverable(exc)
    return ready, refused


def undeliverable(exc: BaseException) -> UndeliverableMessage:
    """The outcome of a message ``exc`` says cannot be encoded."""
    return failure(UndeliverableMessage, f"cannot encode the message: {exc}", exc)


def failure(
    kind: type[DeliveryError], message: str, cause: BaseException | None
) -> DeliveryError:
    """An outcome of ``kind`` with ``message``, caused by ``cause`` (its
    traceback is recorded with the delivery's failure)."""
    error = kind(message)
    error.__cause__ = cause
    return error
