"""OpenTelemetry (outbox_app/execution/tracing.py), with the SDK's in-memory
exporter: the trace context goes from the publishing span into the event's
headers and the CloudEvent, and the relay's spans link back to it (the
``spans`` fixture is tests/conftest.py's)."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import transaction
from kombu import Connection, Exchange, Queue
from opentelemetry import trace

from outbox_app import OutboxEvent, publish
from outbox_app.relay import relay_once
from outbox_app.relay.registry import close_publishers
from tests.testapp.events import OrderPlaced

pytestmark = pytest.mark.django_db(transaction=True)


def ids(traceparent: str) -> tuple[int, int]:
    """(trace id, span id) of a W3C ``traceparent`` header."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return int(trace_id, 16), int(span_id, 16)


def of(span) -> tuple[int, int]:
    context = span.get_span_context()
    return context.trace_id, context.span_id


def test_publish_stores_the_trace_context_and_handlers_link_to_it(spans, handlers):
    handlers("record")
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request, transaction.atomic():
        [event] = publish(OrderPlaced(order_id=1, total=1))
    stored = OutboxEvent.objects.get(pk=event.id).headers
    assert ids(stored["traceparent"]) == of(request)

    report = relay_once(kind="handler")
    assert report.succeeded == 2
    handled = [s for s in spans.get_finished_spans() if s.name.startswith("outbox")]
    assert sorted(s.name for s in handled) == ["outbox handle OrderPlaced"] * 2
    request_context = request.get_span_context()
    for span in handled:
        assert span.kind == trace.SpanKind.CONSUMER
        assert [link.context.span_id for link in span.links] == [
            request_context.span_id
        ]
        assert span.attributes["messaging.message.id"] == str(event.id)
        assert span.attributes["messaging.destination.name"] in {
            "record_a",
            "record_b",
        }


def test_a_failing_handler_span_records_the_error(spans, handlers):
    handlers("broken")
    with transaction.atomic():
        publish(OrderPlaced(order_id=2, total=1))
    assert relay_once(kind="handler").failed == 1
    [span] = [s for s in spans.get_finished_spans() if s.name.startswith("outbox")]
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.events[0].name == "exception"
    assert not span.links  # published outside any span: nothing to link to


def test_broker_batches_carry_the_trace_as_cloudevents_extension(spans, settings):
    name = f"tracing-{uuid.uuid4().hex[:8]}"
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": "memory://", "EXCHANGE": name, "DECLARE": [name]}
    }
    try:
        tracer = trace.get_tracer("tests")
        with tracer.start_as_current_span("job") as job, transaction.atomic():
            publish(*[OrderPlaced(order_id=i, total=1) for i in range(3)])
        assert relay_once(kind="publisher").succeeded == 3
    finally:
        close_publishers()
    [batch] = [s for s in spans.get_finished_spans() if s.name == "outbox publish bus"]
    assert batch.kind == trace.SpanKind.PRODUCER
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert {link.context.span_id for link in batch.links} == {
        job.get_span_context().span_id
    }
    with Connection("memory://") as connection:  # what went on the wire
        queue = Queue(name, Exchange(name, "topic", durable=True), "#")(
            connection.default_channel
        )
        envelopes = []
        while (message := queue.get(no_ack=True)) is not None:
            envelopes.append(json.loads(message.body))
        queue.delete()
    assert len(envelopes) == 3
    assert {ids(envelope["traceparent"]) for envelope in envelopes} == {of(job)}


def test_without_a_span_nothing_is_added(spans):
    with transaction.atomic():
        [event] = publish(OrderPlaced(order_id=3, total=1), headers={"a": 1})
    assert OutboxEvent.objects.get(pk=event.id).headers == {"a": 1}
