"""One trace from a request to the consumer, across three processes: this
one publishes inside a request's span (the SDK's in-memory exporter, the
``spans`` fixture), ``manage.py relay`` delivers to a handler and to real
RabbitMQ, and ``manage.py consume`` runs the consumer; both export their
spans to files (tests/tracing_settings.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from django.db import transaction
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from outbox_app import publish
from outbox_app.store.lifecycle import State
from tests import kit
from tests.processes import Watched, spawn, wait_for
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)

SETTINGS = "--settings=tests.tracing_settings"


def exported(path: Path) -> list[dict]:
    """The spans a process wrote to ``path``, one JSON object a line."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def hexed(span) -> tuple[str, str]:
    """(trace id, span id) of an in-memory span, as the files write them."""
    context = span.get_span_context()
    return f"{context.trace_id:032x}", f"{context.span_id:016x}"


def test_one_trace_from_the_request_to_the_consumer(rabbitmq, unique, spans, tmp_path):
    """request > outbox create (publish) > the relay's handler calls and its
    broker batch, and, through the CloudEvent's ``traceparent`` and
    ``tracestate``, the consumer's call in ``consume``: one trace id, each
    a child of publish()'s span and linked to it."""
    queue = f"{unique}-in"
    rabbitmq.delete_later(queue)
    rabbitmq.exchange(unique)  # deleted afterwards
    relayed, consumed = tmp_path / "relay.jsonl", tmp_path / "consume.jsonl"
    consumer = Watched(
        spawn(
            "manage.py",
            "consume",
            SETTINGS,
            OUTBOX_TEST_SPANS=str(consumed),
            OUTBOX_TEST_INBOX_URL=rabbitmq.url,
            OUTBOX_TEST_INBOX_EXCHANGE=unique,
            OUTBOX_TEST_CONSUMER_QUEUE=queue,
        )
    )
    try:
        wait_for(lambda: consumer.has("consume ready"), 30, "consume to be ready")
        # The request arrives with its caller's trace context (a gateway's
        # traceparent and tracestate): the request's span continues it.
        caller = SpanContext(
            trace_id=random.getrandbits(128),
            span_id=random.getrandbits(64),
            is_remote=True,
            trace_flags=TraceFlags(TraceFlags.SAMPLED),
            trace_state=TraceState([("shop", "gw1")]),
        )
        tracer = trace.get_tracer("tests")
        with (
            tracer.start_as_current_span(
                "POST /orders",
                context=trace.set_span_in_context(NonRecordingSpan(caller)),
                kind=trace.SpanKind.SERVER,
            ) as request,
            transaction.atomic(),
        ):
            [event] = publish(OrderPlaced(order_id=1, total=1))
        relay = Watched(
            spawn(
                "manage.py",
                "relay",
                SETTINGS,
                "--once",
                OUTBOX_TEST_SPANS=str(relayed),
                OUTBOX_TEST_HANDLER_SETS="record",
                OUTBOX_TEST_PUBLISHERS=json.dumps(
                    {"bus": {"URL": rabbitmq.url, "EXCHANGE": unique}}
                ),
            )
        )
        assert relay.process.wait(60) == 0, relay.text()
        relay.stop()
        assert set(kit.states()) == {State.SUCCEEDED}

        def handled() -> bool:
            return SideEffect.objects.filter(handler="tests.inbox").exists() and any(
                s["name"] == "outbox consume OrderPlaced" for s in exported(consumed)
            )

        wait_for(handled, 30, "the consumer's span")
    finally:
        assert consumer.stop() == 0, consumer.text()

    trace_id, request_id = hexed(request)
    [created] = [s for s in spans.get_finished_spans() if s.name.startswith("outbox")]
    assert created.name == "outbox create OrderPlaced"
    assert f"{created.parent.span_id:016x}" == request_id
    _, created_id = hexed(created)

    relay_spans = exported(relayed)
    assert sorted(s["name"] for s in relay_spans) == [
        "outbox handle OrderPlaced",
        "outbox handle OrderPlaced",
        "outbox publish bus",
    ]
    [consumer_span] = exported(consumed)
    assert consumer_span["name"] == "outbox consume OrderPlaced"
    assert consumer_span["kind"] == "CONSUMER"
    assert consumer_span["status"] == "UNSET"
    assert consumer_span["attributes"]["messaging.message.id"] == str(event.id)
    assert consumer_span["attributes"]["messaging.destination.name"] == queue
    for span in [*relay_spans, consumer_span]:
        assert span["trace_id"] == trace_id, span
        assert span["parent_id"] == created_id, span
        assert span["links"] == [created_id], span
    # The caller's tracestate went through the outbox and the wire.
    assert consumer_span["trace_state"] == "shop=gw1"
    assert created.context.trace_state.to_header() == "shop=gw1"
