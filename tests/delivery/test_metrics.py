"""The relay's own metrics (outbox_app/execution/metrics.py), counted in this
process on a registry of the test's own: the delivery latency is a delivered
row's, never a failed, dead or lapsed one's."""

from __future__ import annotations

import datetime
import uuid

import pytest
from django.db import transaction
from prometheus_client import CollectorRegistry

from outbox_app import publish
from outbox_app.execution.metrics import relay_metrics
from outbox_app.relay import relay_once
from outbox_app.relay.registry import close_publishers
from outbox_app.store.clock import database_now
from tests.testapp.events import OrderPlaced

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def metrics(monkeypatch):
    """``relay_metrics`` enabled for the test, on a registry of its own;
    disabled again afterwards."""
    registry = CollectorRegistry()
    monkeypatch.setattr(relay_metrics, "enabled", False)
    relay_metrics.enable(None, registry=registry)
    return registry


def test_latency_counts_delivered_rows_only(metrics, registered, settings):
    """Two events reach a handler and a broker publisher (SUCCEEDED); a
    handler that always raises sends them to the dead letter; a third
    event expires before the relay comes (SKIPPED, lapsed, for each)."""
    name = f"metrics-{uuid.uuid4().hex[:8]}"
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": "memory://", "EXCHANGE": name, "DECLARE": [name]}
    }

    @registered(OrderPlaced, name="ok")
    def ok(event, context):
        pass

    @registered(OrderPlaced, name="doomed", max_attempts=1)
    def doomed(event, context):
        raise ValueError("never")

    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=1), OrderPlaced(order_id=2, total=1))
        publish(
            OrderPlaced(order_id=3, total=1),
            expires_at=datetime.timedelta(minutes=1),
        )
    later = database_now("default") + datetime.timedelta(minutes=2)
    try:
        report = relay_once(now=later)
    finally:
        close_publishers()
    assert (report.succeeded, report.dead, report.lapsed) == (4, 2, 3)

    def sample(metric: str, subscriber: str, **labels) -> float:
        labels = {"subscriber": subscriber, **labels}
        return metrics.get_sample_value(metric, labels) or 0.0

    latency = "outbox_relay_delivery_latency_seconds_count"
    outcomes = "outbox_relay_outcomes_total"
    assert {s: sample(latency, s) for s in ("ok", "bus", "doomed")} == {
        "ok": 2,
        "bus": 2,
        "doomed": 0,
    }
    assert sample(outcomes, "doomed", outcome="dead") == 2
    assert sample(outcomes, "ok", outcome="lapsed") == 1
    # Published a moment ago by the database's clock, marked just now.
    assert 0 <= sample("outbox_relay_delivery_latency_seconds_sum", "ok") < 60
    assert sample("outbox_relay_batch_seconds_count", "doomed") == 1
