"""OpenTelemetry: one trace from a request through the commit to each delivery
and each consumer.

Optional: with ``opentelemetry-api`` installed (``outbox_app[otel]``) and a
tracer provider configured by the project (the SDK and an exporter) in each
process (the web's, ``relay``'s, ``consume``'s),

- :func:`creating`: ``publish()`` opens a span (``outbox create
  OrderPlaced``, kind PRODUCER: the messaging conventions' *create*) inside
  a trace, a child of the current span (the request's, which
  opentelemetry-instrumentation-django opens), and :func:`inject` stores its
  context in the events' headers (``traceparent``, ``tracestate``: W3C Trace
  Context, through the project's global propagator): each event's
  *creation context*. Headers that carry a ``traceparent`` of the caller's
  own keep it, and no span is opened;
- broker messages carry it as the CloudEvents distributed-tracing extension
  (``traceparent`` / ``tracestate`` attributes, publishers/cloudevents.py);
- :func:`span`: the relay opens a span per handler call (kind CONSUMER) and
  per broker batch (PRODUCER), and ``consume`` one per consumer call
  (CONSUMER), each a *child* of the creation context its events share (a
  call's one event; a batch whose events one ``publish()`` created) and
  *linked* to each of them, as the messaging conventions ask: one trace
  from the request through the relay to every consumer, and a batch of many
  requests' events, a trace of its own, leads back to each.

Without the package, or with it and no tracer provider configured, every
function returns at once (measured: docs/operations.md, "Traces").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

try:
    from opentelemetry import propagate, trace
except ImportError:  # the optional extra is not installed
    propagate = trace = None

#: Tracer providers of a process that configured none: the API's default.
_NOT_CONFIGURED = (
    () if trace is None else (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
)
#: The headers :func:`inject` writes (the W3C Trace Context fields).
TRACE_HEADERS = ("traceparent", "tracestate")
#: Links per broker batch span, at most (a batch may hold 500 events).
MAX_LINKS = 128


def inject(headers: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``headers`` with the current trace context added, when a span is
    active and ``headers`` has none of its own; else ``headers`` itself."""
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        return headers
    if headers and any(key in headers for key in TRACE_HEADERS):
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    found = {key: carrier[key] for key in TRACE_HEADERS if key in carrier}
    return {**(headers or {}), **found} if found else headers


def recording() -> bool:
    """Whether a span would be recorded: the package is installed and the
    project configured a tracer provider. Who runs user code asks first and
    builds a span's name and attributes only then."""
    return trace is not None and not isinstance(
        trace.get_tracer_provider(), _NOT_CONFIGURED
    )


def _carrier(headers: Mapping[str, Any]) -> dict[str, str]:
    return {k: str(headers[k]) for k in TRACE_HEADERS if k in headers}


@contextlib.contextmanager
def creating(headers: Mapping[str, Any] | None) -> Iterator[Any]:
    """The span of one ``publish()`` call, current within the block so that
    :func:`inject` stores its context in the events' headers: their
    *creation context* (OpenTelemetry's messaging conventions), which the
    relay's and ``consume``'s spans continue. Kind PRODUCER, a child of the
    current span (the request's, with opentelemetry-instrumentation-django);
    named by :func:`created` once the events are known. None is yielded, and
    no span opened, when nothing would record it, outside any trace (no
    current span: a command, a migration's bulk writes; publish() joins a
    trace, it starts none), or when ``headers`` carry a ``traceparent`` of
    the caller's own (a creation context given is never replaced). An
    exception escaping the block is recorded on the span."""
    if (
        not recording()
        or (isinstance(headers, Mapping) and "traceparent" in headers)
        or not trace.get_current_span().get_span_context().is_valid
    ):
        yield None
        return
    tracer = trace.get_tracer("outbox_app")
    with tracer.start_as_current_span(
        "outbox create",
        kind=trace.SpanKind.PRODUCER,
        attributes={
            "messaging.system": "outbox_app",
            "messaging.operation.type": "create",
            "messaging.operation.name": "publish",
        },
    ) as current:
        yield current


def created(current: Any, events: Sequence[tuple[str | None, Any]]) -> None:
    """Name :func:`creating`'s span ``current`` (None: no span) by the
    events written, ``(event type, event id)`` each: ``outbox create
    OrderPlaced`` (one type), with the event's id (``messaging.message.id``)
    or the batch's size (``messaging.batch.message_count``)."""
    types = sorted({event_type for event_type, _ in events if event_type})
    if current is None or not types:
        return
    current.update_name(
        f"outbox create {types[0]}" if len(types) == 1 else "outbox create"
    )
    if len(events) == 1:
        current.set_attribute("messaging.message.id", str(events[0][1]))
    else:
        current.set_attribute("messaging.batch.message_count", len(events))
    current.set_attribute("outbox.event_types", types)


def _creation(headers: Iterable[Mapping[str, Any] | None]) -> tuple[list, Any]:
    """``(links, parent)`` of a span accounting for the messages of
    ``headers``: a link to each distinct creation context (their
    ``traceparent``, at most :data:`MAX_LINKS`), and the creation context
    that every one of them shares, as the span's parent context (None when
    one has none, or two differ: the span's parent is then the current
    span, if any; the links lead back)."""
    links: dict[str, Any] = {}
    shared: str | None = None
    common = True
    for event_headers in headers:
        traceparent = event_headers.get("traceparent") if event_headers else None
        if traceparent is None or (shared is not None and traceparent != shared):
            common = False
        shared = shared or traceparent
        if traceparent is None or traceparent in links or len(links) == MAX_LINKS:
            continue
        context = trace.get_current_span(propagate.extract(_carrier(event_headers)))
        span_context = context.get_span_context()
        links[traceparent] = trace.Link(span_context) if span_context.is_valid else None
    link = links.get(shared) if common else None
    parent = (
        trace.set_span_in_context(trace.NonRecordingSpan(link.context))
        if link
        else None
    )
    return [found for found in links.values() if found is not None], parent


@contextlib.contextmanager
def span(
    name: str,
    *,
    producer: bool,
    headers: Iterable[Mapping[str, Any] | None],
    attributes: Mapping[str, Any],
) -> Iterator[Any]:
    """A span around one delivery step, in the trace of the events it
    delivers: a child of their creation context (the ``publish()`` span
    whose ``traceparent`` their headers carry) when they all share one (a
    handler's or a consumer's call: its one event), else of the current
    span (none: the root of a trace of its own); linked to each creation
    context either way, as the messaging conventions ask. An exception
    escaping the block is recorded on the span, which ends with an error
    status.

    Args:
        name: the span name (``"outbox handle OrderPlaced"``).
        producer: a broker batch (PRODUCER) or a handler's or a consumer's
            call (CONSUMER).
        headers: the delivered events' headers.
        attributes: span attributes (``messaging.*``, ``outbox.*``).
    """
    if not recording():
        # Nothing would record the span: skip the API's no-op work too (about
        # 7 us a handler call, 7% of a no-op handler's delivery).
        yield None
        return
    links, parent = _creation(headers)
    tracer = trace.get_tracer("outbox_app")
    kind = trace.SpanKind.PRODUCER if producer else trace.SpanKind.CONSUMER
    with tracer.start_as_current_span(
        name, context=parent, kind=kind, links=links, attributes=dict(attributes)
    ) as current:
        yield current
