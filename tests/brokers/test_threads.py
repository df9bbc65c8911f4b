"""Relays in threads of one process (Celery's thread and gevent pools run
``relay_events`` side by side): each thread publishes on its own connection,
so confirms are credited to the batch they confirm."""

from __future__ import annotations

import decimal
import threading

import pytest
from django.db import connections, transaction
from django.test import skipUnlessDBFeature

from outbox_app import publish
from outbox_app.relay.registry import close_publishers
from outbox_app.store.lifecycle import State
from tests import kit
from tests.delivery.test_delivery import deliver, fan_out
from tests.testapp.events import OrderPlaced

pytestmark = pytest.mark.django_db(transaction=True)


@skipUnlessDBFeature("has_select_for_update_skip_locked")
def test_threads_relaying_one_publisher_credit_each_confirm_once(
    rabbitmq, settings, unique
):
    queue = rabbitmq.bind(f"{unique}-q", unique)
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": rabbitmq.url, "EXCHANGE": unique, "CONFIRM_TIMEOUT": 30}
    }
    total = 2000
    with transaction.atomic():
        publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(total)]
        )
    fan_out()
    reports, errors = [], []

    def relay():
        try:
            reports.append(deliver(kind="publisher", batch_size=50))
        except Exception as exc:  # reported below
            errors.append(exc)
        finally:
            connections["default"].close()

    try:
        threads = [threading.Thread(target=relay) for _ in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
    finally:
        close_publishers()
    assert not errors, errors
    assert sum(r.succeeded for r in reports) == total
    assert sum(r.failed + r.dead + r.lost for r in reports) == 0
    assert kit.states() == {State.SUCCEEDED: total}
    ids = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert len(ids) == len(set(ids)) == total
