"""Settings of the processes whose spans a test reads: tests/settings.py, and
an OpenTelemetry SDK tracer provider, configured once per process as a
project configures its own, that appends each finished span to the file
``OUTBOX_TEST_SPANS`` as one JSON line (tests/brokers/test_tracing.py reads
them back)."""

import json
import os

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor

from tests.settings import *  # noqa: F403


def _line(span) -> str:
    """One finished span as the tests read it: ids as hex, as in a
    ``traceparent``."""
    context = span.get_span_context()
    return (
        json.dumps(
            {
                "name": span.name,
                "kind": span.kind.name,
                "trace_id": f"{context.trace_id:032x}",
                "span_id": f"{context.span_id:016x}",
                "parent_id": None
                if span.parent is None
                else f"{span.parent.span_id:016x}",
                "links": [f"{link.context.span_id:016x}" for link in span.links],
                "trace_state": context.trace_state.to_header(),
                "status": span.status.status_code.name,
                "attributes": dict(span.attributes),
            }
        )
        + "\n"
    )


_provider = TracerProvider()
_provider.add_span_processor(
    # Exported as each span ends: a process stopped by a signal loses none.
    SimpleSpanProcessor(
        ConsoleSpanExporter(
            out=open(os.environ["OUTBOX_TEST_SPANS"], "a", buffering=1),  # noqa: SIM115
            formatter=_line,
        )
    )
)
trace.set_tracer_provider(_provider)
