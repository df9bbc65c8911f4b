"""What a consumer shares with a handler, the wrapper that runs user code
(outbox_app/execution/run.py): its time limit, its span (OpenTelemetry's SDK,
in-memory), its metrics (prometheus-client, a registry of the test's own)."""

from __future__ import annotations

import time

import pytest
from django.db import transaction
from django.utils import timezone
from opentelemetry import trace

from outbox_app import InboxMessage
from outbox_app.execution import tracing
from outbox_app.inbox import receive, receive_batch, retry_due
from outbox_app.store.lifecycle import InboxState
from tests.inbox.conftest import LATER, QUEUE, batch_of, message, mine
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_consumer_past_its_timeout_is_failed_and_retried(consumer):
    """The first run (receive) and the retry (retry_due) are both timed: a
    CallTimeout fails the attempt, its writes are rolled back, and the
    message runs again until a fast attempt handles it."""

    @consumer(OrderPlaced, name="slow", timeout=0.2)
    def slow(event, context):
        SideEffect.objects.create(
            handler="slow", event_id=context.event_id, position=context.attempt
        )
        if context.attempt < 3:
            time.sleep(5)

    began = time.monotonic()
    assert receive(message(1), QUEUE, mine()).failed == 1
    row = InboxMessage.objects.get()
    assert (row.state, row.attempts) == (InboxState.FAILED, 1)
    assert row.last_error == "consumer ran longer than its timeout of 0.2s"
    assert row.last_error_type == "outbox_app.exceptions.CallTimeout"
    assert retry_due(mine(), limit=1, now=timezone.now() + LATER).failed == 1
    row.refresh_from_db()
    assert (row.state, row.attempts) == (InboxState.FAILED, 2)
    assert row.last_error_type == "outbox_app.exceptions.CallTimeout"
    assert retry_due(mine(), now=timezone.now() + 2 * LATER).handled == 1
    assert time.monotonic() - began < 3
    row.refresh_from_db()
    assert (row.state, row.attempts) == (InboxState.HANDLED, 3)
    # The timed-out attempts' writes were rolled back with them.
    assert list(SideEffect.objects.values_list("position", flat=True)) == [3]


def test_a_consumer_call_is_a_span_in_the_publishing_trace(spans, consumer):
    @consumer(OrderPlaced, name="traced")
    def traced(event, context):
        if event.order_id == 2:
            raise RuntimeError("order 2 is broken")

    tracer = trace.get_tracer("tests")
    with tracer.start_as_current_span("POST /orders") as request:
        headers = tracing.inject({})
    assert "traceparent" in headers
    bodies = [message(n, headers=headers) for n in (1, 2)]
    tally = receive_batch(batch_of(*bodies), {QUEUE: mine()})
    assert (tally.handled, tally.failed) == (1, 1)

    consumed = [
        s for s in spans.get_finished_spans() if s.name == "outbox consume OrderPlaced"
    ]
    # 1 ran in the batch, which 2 rolled back, then each alone: 1 again; 2's
    # failure is recorded without calling it twice.
    assert len(consumed) == 3
    ids = {row.message_id: row.state for row in InboxMessage.objects.all()}
    for span in consumed:
        assert span.kind == trace.SpanKind.CONSUMER
        assert span.attributes["messaging.consumer.group.name"] == "traced"
        assert span.attributes["messaging.destination.name"] == QUEUE
        assert span.attributes["messaging.message.id"] in ids
        # The message's creation context is its parent and its link.
        assert span.parent.span_id == request.get_span_context().span_id
        assert span.context.trace_id == request.get_span_context().trace_id
        assert [link.context.span_id for link in span.links] == [
            request.get_span_context().span_id
        ]
    [failed] = [s for s in consumed if s.status.status_code == trace.StatusCode.ERROR]
    assert ids[failed.attributes["messaging.message.id"]] == InboxState.FAILED
    assert failed.events[0].name == "exception"
    assert failed.attributes["outbox.attempt"] == 1


def test_consumer_outcomes_are_counted(metrics, consumer):
    """handled, failed, dead per consumer, once each message's row is
    written; a raising on_commit callback counts as its message's failure;
    failures by error class; every call timed."""

    @consumer(OrderPlaced, name="counted", max_attempts=2)
    def counted(event, context):
        if event.order_id == 13:
            raise ValueError("unlucky")
        if event.order_id == 7:
            transaction.on_commit(lambda: 1 / 0)

    def sample(name: str, **labels) -> float:
        value = metrics.get_sample_value(name, {"consumer": "counted", **labels})
        return value or 0.0

    def outcome(word: str) -> float:
        return sample("outbox_consume_outcomes_total", outcome=word)

    tally = receive_batch(
        batch_of(*(message(n) for n in (1, 2, 13, 7))), {QUEUE: mine()}
    )
    assert (tally.handled, tally.failed) == (2, 2)
    assert (outcome("handled"), outcome("failed"), outcome("dead")) == (2, 2, 0)
    assert receive(b"not json", QUEUE, mine()).dead == 1
    assert retry_due(mine(), now=timezone.now() + LATER).dead == 2
    assert (outcome("handled"), outcome("failed"), outcome("dead")) == (2, 2, 3)
    errors = {
        error: sample("outbox_consume_failures_total", error=error)
        for error in (
            "builtins.ValueError",
            "builtins.ZeroDivisionError",
            "outbox_app.exceptions.UndecodableMessage",
        )
    }
    assert errors == {
        "builtins.ValueError": 2,
        "builtins.ZeroDivisionError": 2,
        "outbox_app.exceptions.UndecodableMessage": 1,
    }
    # 1, 2, 13 in the batch (13 raised), 1 and 2 again alone, 7 alone, then
    # the two retries.
    assert sample("outbox_consume_consumer_seconds_count") == 8


def test_duplicates_expired_and_latency_are_counted(metrics, consumer):
    """A message already in the inbox counts as ``duplicate`` (in a batch and
    alone), one past its expiretime as ``expired``; the latency from
    publish to commit is observed for handled messages only, never for a
    failed, dead or duplicate one."""

    @consumer(OrderPlaced, name="counted", max_attempts=1)
    def counted(event, context):
        if event.order_id == 13:
            raise ValueError("unlucky")

    def sample(name: str, **labels) -> float:
        value = metrics.get_sample_value(name, {"consumer": "counted", **labels})
        return value or 0.0

    def outcome(word: str) -> float:
        return sample("outbox_consume_outcomes_total", outcome=word)

    first, second = message(1), message(2)
    expired = message(3, expires_at=timezone.now() - LATER)
    tally = receive_batch(batch_of(first, second, expired), {QUEUE: mine()})
    assert (tally.handled, tally.expired) == (2, 1)
    assert sample("outbox_consume_latency_seconds_count") == 2
    # Redelivered: as one batch, and one message alone.
    assert receive_batch(batch_of(first, second), {QUEUE: mine()}).duplicates == 2
    assert receive(first, QUEUE, mine()).duplicates == 1
    assert receive(message(13), QUEUE, mine()).dead == 1
    assert (outcome("handled"), outcome("duplicate"), outcome("expired")) == (2, 3, 1)
    assert outcome("dead") == 1
    assert sample("outbox_consume_latency_seconds_count") == 2
    # Published a moment ago: well under a minute.
    assert 0 <= sample("outbox_consume_latency_seconds_sum") < 60
