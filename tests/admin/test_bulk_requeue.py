""" "Requeue everything matching the current filter" on 100,000 rows: batched,
in bounded memory."""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.store.lifecycle import State

pytestmark = [pytest.mark.django_db, pytest.mark.slow]

ROWS = 100_000
SUBSCRIBERS = 100  # x 1,000 events: (event, subscriber) is unique


def insert_expired_rows() -> None:
    """ROWS expired deliveries: SUBSCRIBERS x the events, made in SQL (one
    INSERT ... SELECT per subscriber, one UPDATE)."""
    with transaction.atomic():
        publish(
            *[
                {"event_type": "OrderPlaced", "payload": {"n": i}}
                for i in range(ROWS // SUBSCRIBERS)
            ]
        )
    now = timezone.now()
    for s in range(SUBSCRIBERS):
        Delivery.objects.create_for(OutboxEvent.objects.all(), f"sub-{s:03}", now)
    Delivery.objects.update(
        state=State.DEAD,
        attempts=10,
        completed_at=now,
        last_error="broker down",
        last_error_type="builtins.ConnectionError",
    )


def peak_bytes(fn) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_requeue_matching__100k_rows_in_bounded_memory(admin_client):
    insert_expired_rows()
    # One more row outside the filter, which must stay expired.
    outside = Delivery.objects.filter(subscriber="sub-000").first()
    Delivery.objects.filter(pk=outside.pk).update(last_error_type="builtins.Other")
    assert Delivery.objects.filter(state=State.DEAD).count() == ROWS

    # What holding every matching row would cost, extrapolated from 5,000.
    sample = 5_000
    per_row = peak_bytes(lambda: list(Delivery.objects.all()[:sample])) / sample
    loading_all = per_row * ROWS

    url = reverse("admin:outbox_app_delivery_requeue_matching")
    query = "?state__exact=DEAD&last_error_type__exact=builtins.ConnectionError"
    responses = []
    peak = peak_bytes(lambda: responses.append(admin_client.post(url + query)))

    assert responses[0].status_code == 302
    assert Delivery.objects.filter(state=State.PENDING).count() == ROWS - 1
    assert Delivery.objects.get(pk=outside.pk).state == State.DEAD
    # Bounded: one batch of ids at a time, not the rows.
    assert loading_all > 50 * 1024 * 1024, loading_all  # the sample is meaningful
    assert peak < loading_all / 10, (peak, loading_all)
    assert peak < 16 * 1024 * 1024, peak
