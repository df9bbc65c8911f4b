"""Fixtures of the inbox tests: messages as outbox_app's publishers send
them, and consumers registered for one test."""

from __future__ import annotations

import datetime
import uuid

import pytest
from django.utils import timezone

from outbox_app.inbox.registry import consumer as register
from outbox_app.inbox.registry import consumers, unregister_consumer
from outbox_app.publishers.cloudevents import body
from outbox_app.subscribers import DeliveryContext

QUEUE = "tests.inbox"
LATER = datetime.timedelta(hours=1)


def message(
    order_id: int = 1,
    *,
    event_id: uuid.UUID | None = None,
    aggregate: str = "1",
    event_type: str = "OrderPlaced",
    payload: dict | None = None,
    expires_at: datetime.datetime | None = None,
    source: str = "shop",
    headers: dict | None = None,
) -> bytes:
    """A message as outbox_app's KombuPublisher sends it (``headers``: the
    event's, default a correlation id)."""
    context = DeliveryContext(
        event_id=event_id or uuid.uuid4(),
        namespace=source,
        event_type=event_type,
        revision=1,
        payload=payload or {"order_id": order_id, "total": "9.99"},
        aggregate_type="shop.Order",
        aggregate_id=aggregate,
        aggregate_version=None,
        headers={"correlation_id": "req-1"} if headers is None else headers,
        tenant_id=None,
        action_id=None,
        occurred_at=timezone.now(),
        attempt=1,
        subscriber="rabbitmq",
        delivery_id=1,
        expires_at=expires_at,
    )
    return body(context)


@pytest.fixture
def metrics(monkeypatch):
    """``consume_metrics`` enabled for the test, on a registry of its own
    (read with ``get_sample_value``); disabled again afterwards."""
    from prometheus_client import CollectorRegistry

    from outbox_app.execution.metrics import consume_metrics

    registry = CollectorRegistry()
    monkeypatch.setattr(consume_metrics, "enabled", False)
    consume_metrics.enable(None, registry=registry)
    return registry


@pytest.fixture
def consumer():
    """Register consumers on QUEUE for one test."""
    names = []

    def add(*types, name, **options):
        def decorate(fn):
            register(*types, queue=options.pop("queue", QUEUE), name=name, **options)(
                fn
            )
            names.append(name)
            return fn

        return decorate

    yield add
    for name in names:
        unregister_consumer(name)


def mine():
    return consumers([QUEUE])


def batch_of(*bodies: bytes, queue: str = QUEUE) -> list[tuple[bytes, str, None]]:
    return [(b, queue, None) for b in bodies]
