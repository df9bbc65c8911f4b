"""OpenTelemetry: one trace from a request through the commit to each delivery.

Optional: with ``opentelemetry-api`` installed (``outbox_app[otel]``) and a
tracer provider configured by the project (the SDK and an exporter),

- :func:`inject`: ``publish()`` stores the current W3C trace context in the
  event's headers (``traceparent``, ``tracestate``; the W3C Trace Context
  format, through the project's global propagator), unless the caller set
  them;
- broker messages carry them as the CloudEvents distributed-tracing extension
  (``traceparent`` / ``tracestate`` attributes, publishers/cloudevents.py);
- :func:`span`: the relay opens a span per handler call (kind CONSUMER) and
  per broker batch (PRODUCER), and ``consume`` one per consumer call
  (CONSUMER), *linked* to the publishing spans (a delivery runs later, in
  another process: a link, not a parent, as the OpenTelemetry messaging
  conventions say), so a trace viewer goes from the request to its
  deliveries and back.

Without the package, or with it and no tracer provider configured, every
function returns at once (bench/bench_tracing.py measures publish()).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
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


def _link(headers: Mapping[str, Any] | None):
    if not headers or "traceparent" not in headers:
        return None
    carrier = {k: str(headers[k]) for k in TRACE_HEADERS if k in headers}
    context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
    return trace.Link(context) if context.is_valid else None


@contextlib.contextmanager
def span(
    name: str,
    *,
    producer: bool,
    headers: Iterable[Mapping[str, Any] | None],
    attributes: Mapping[str, Any],
) -> Iterator[Any]:
    """A span around one delivery step, linked to the spans that published
    its events (from their ``traceparent`` headers). An exception escaping
    the block is recorded on the span, which ends with an error status.

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
    links = []
    for event_headers in headers:
        link = _link(event_headers)
        if link is not None:
            links.append(link)
            if len(links) == MAX_LINKS:
                break
    tracer = trace.get_tracer("outbox_app")
    kind = trace.SpanKind.PRODUCER if producer else trace.SpanKind.CONSUMER
    with tracer.start_as_current_span(
        name, kind=kind, links=links, attributes=dict(attributes)
    ) as current:
        yield current
