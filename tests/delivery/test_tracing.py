"""OpenTelemetry (outbox_app/execution/tracing.py), with the SDK's in-memory
exporter: ``publish()`` opens a span whose context goes into the event's
headers and the CloudEvent, and the relay's spans continue its trace (the
``spans`` fixture is tests/conftest.py's). Across processes, up to
``consume``: tests/brokers/test_tracing.py."""

from __future__ import annotations

import json
import uuid

import pytest
from django.db import transaction
from kombu import Connection, Exchange, Queue
from opentelemetry import trace

from outbox_app import InvalidPayload, OutboxEvent, publish
from outbox_app.relay import relay_once
from outbox_app.relay.registry import close_publishers
from tests.processes import spawn
from tests.testapp.events import OrderPlaced

pytestmark = pytest.mark.django_db(transaction=True)


def ids(traceparent: str) -> tuple[int, int]:
    """(trace id, span id) of a W3C ``traceparent`` header."""
    _, trace_id, span_id, _ = traceparent.split("-")
    return int(trace_id, 16), int(span_id, 16)


def of(span) -> tuple[int, int]:
    context = span.get_span_context()
    return context.trace_id, context.span_id


def named(spans, name: str) -> list:
    return [s for s in spans.get_finished_spans() if s.name == name]


def test_publish_opens_a_span_and_handlers_continue_its_trace(spans, handlers):
    """The request's span > ``outbox create OrderPlaced`` (publish(), whose
    context the event keeps) > each handler's call, linked to it too."""
    handlers("record")
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request, transaction.atomic():
        [event] = publish(OrderPlaced(order_id=1, total=1))
    [created] = named(spans, "outbox create OrderPlaced")
    assert created.kind == trace.SpanKind.PRODUCER
    assert created.parent.span_id == request.get_span_context().span_id
    assert created.attributes["messaging.operation.type"] == "create"
    assert created.attributes["messaging.message.id"] == str(event.id)
    stored = OutboxEvent.objects.get(pk=event.id).headers
    assert ids(stored["traceparent"]) == of(created)

    report = relay_once(kind="handler")
    assert report.succeeded == 2
    handled = named(spans, "outbox handle OrderPlaced")
    assert len(handled) == 2
    for span in handled:
        assert span.kind == trace.SpanKind.CONSUMER
        assert span.context.trace_id == request.get_span_context().trace_id
        assert span.parent.span_id == created.context.span_id
        assert [link.context.span_id for link in span.links] == [
            created.context.span_id
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
    [span] = named(spans, "outbox handle OrderPlaced")
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.events[0].name == "exception"
    # Published outside any trace: no creation context, a trace of its own.
    assert not named(spans, "outbox create OrderPlaced")
    assert span.parent is None and not span.links


def test_broker_batches_carry_the_trace_as_cloudevents_extension(spans, settings):
    """One publish() of three events: one creation context, which the batch
    span continues (a child, one link) and the wire carries."""
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
    [created] = named(spans, "outbox create OrderPlaced")
    assert created.attributes["messaging.batch.message_count"] == 3
    [batch] = named(spans, "outbox publish bus")
    assert batch.kind == trace.SpanKind.PRODUCER
    assert batch.attributes["messaging.batch.message_count"] == 3
    assert batch.context.trace_id == job.get_span_context().trace_id
    assert batch.parent.span_id == created.context.span_id
    assert [link.context.span_id for link in batch.links] == [created.context.span_id]
    with Connection("memory://") as connection:  # what went on the wire
        queue = Queue(name, Exchange(name, "topic", durable=True), "#")(
            connection.default_channel
        )
        envelopes = []
        while (message := queue.get(no_ack=True)) is not None:
            envelopes.append(json.loads(message.body))
        queue.delete()
    assert len(envelopes) == 3
    assert {ids(envelope["traceparent"]) for envelope in envelopes} == {of(created)}


def test_a_batch_of_several_traces_is_its_own_linked_to_each(spans, settings):
    name = f"tracing-{uuid.uuid4().hex[:8]}"
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": "memory://", "EXCHANGE": name, "DECLARE": [name]}
    }
    tracer = trace.get_tracer("tests")
    try:
        for order_id in (1, 2):
            with tracer.start_as_current_span("job"), transaction.atomic():
                publish(OrderPlaced(order_id=order_id, total=1))
        assert relay_once(kind="publisher").succeeded == 2
    finally:
        close_publishers()
        with Connection("memory://") as connection:
            Queue(name, Exchange(name, "topic"), "#")(
                connection.default_channel
            ).delete()
    created = named(spans, "outbox create OrderPlaced")
    [batch] = named(spans, "outbox publish bus")
    assert batch.parent is None
    assert batch.context.trace_id not in {s.context.trace_id for s in created}
    assert {link.context.span_id for link in batch.links} == {
        s.context.span_id for s in created
    }


def test_a_traceparent_of_the_callers_own_is_kept(spans):
    """A creation context given in the headers is the event's: publish()
    neither replaces it nor opens a span."""
    given = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("job"), transaction.atomic():
        [event] = publish(
            OrderPlaced(order_id=3, total=1),
            headers={"traceparent": given, "a": 1},
        )
    assert OutboxEvent.objects.get(pk=event.id).headers == {
        "traceparent": given,
        "a": 1,
    }
    assert [s.name for s in spans.get_finished_spans()] == ["job"]


def test_without_a_trace_nothing_is_added(spans):
    """publish() joins a trace, it starts none: outside any span (a command,
    a migration's bulk writes) no span is opened and no header added."""
    with transaction.atomic():
        [event] = publish(OrderPlaced(order_id=3, total=1), headers={"a": 1})
    assert OutboxEvent.objects.get(pk=event.id).headers == {"a": 1}
    assert not spans.get_finished_spans()


def test_a_refused_publish_records_its_error_on_its_span(spans):
    tracer = trace.get_tracer("tests")
    with (
        pytest.raises(InvalidPayload),
        tracer.start_as_current_span("job"),
        transaction.atomic(),
    ):
        publish({"event_type": "OrderPlaced", "payload": {"at": object()}})
    [created] = named(spans, "outbox create")
    assert created.status.status_code == trace.StatusCode.ERROR
    assert created.events[0].attributes["exception.type"].endswith("InvalidPayload")
    assert not OutboxEvent.objects.exists()


#: Run by test_without_the_package_nothing_is_traced, in a process where
#: ``opentelemetry`` cannot be imported (as where it is not installed).
WITHOUT_OTEL = """
import json, sys, uuid
sys.modules["opentelemetry"] = None
import django
django.setup()
from django.db import transaction
from outbox_app import OutboxEvent, publish
from outbox_app.execution import tracing
from outbox_app.inbox import consumers, receive
from outbox_app.relay import relay_once
from tests.testapp.events import OrderPlaced
assert tracing.trace is None
with transaction.atomic():
    [event] = publish(OrderPlaced(order_id=1, total=1), headers={"a": 1})
message = {
    "specversion": "1.0", "id": str(uuid.uuid4()), "source": "shop",
    "type": "OrderPlaced", "data": {"order_id": 2, "total": "1"},
    "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
}
tally = receive(json.dumps(message).encode(), "nootel", consumers(["nootel"]))
print(json.dumps({
    "headers": OutboxEvent.objects.get(pk=event.id).headers,
    "succeeded": relay_once(kind="handler").succeeded,
    "handled": tally.handled,
}))
"""


@pytest.mark.any_database
def test_without_the_package_nothing_is_traced():
    """opentelemetry-api is optional: without it publish(), the relay's
    handlers and the inbox's consumers run as ever, and no header is
    added."""
    process = spawn(
        "-c",
        WITHOUT_OTEL,
        OUTBOX_TEST_HANDLER_SETS="record",
        OUTBOX_TEST_CONSUMER_QUEUE="nootel",
        OUTBOX_TEST_INBOX_URL="memory://",
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert json.loads(out) == {"headers": {"a": 1}, "succeeded": 2, "handled": 1}
