"""Relays claiming side by side on one database: a deadlock the database
breaks (InnoDB picks a victim among concurrent skip-locked claims) costs a
retry, not the relay's iteration."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections, transaction
from django.test import skipUnlessDBFeature

from outbox_app import Notification, publish
from outbox_app.delivery.batch import Batch
from outbox_app.delivery.fanout import fan_out
from outbox_app.registry import get
from outbox_app.states import State
from tests.testapp.events import Step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.slow
@skipUnlessDBFeature("has_select_for_update_skip_locked")
def test_ordered_claims_side_by_side_never_fail(registered):
    @registered(Step, name="ordered", ordered=True)
    def ordered(event, context):
        pass

    aggregates, steps = 40, 20
    with transaction.atomic():
        for position in range(steps):
            for aggregate in range(aggregates):
                publish(Step(position=position), aggregate=("shop.Cart", aggregate))
    fan_out()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 4

    def claimer(number: int) -> None:
        subscriber = get("ordered")
        try:
            while time.monotonic() < deadline:
                batch = Batch.claim(subscriber, "default", 20, None, f"w:{number}")
                batch.gateway.succeed(
                    batch.token, [c.notification_id for c in batch.contexts], batch.now
                )
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    threads = [threading.Thread(target=claimer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    assert Notification.objects.filter(state=State.SUCCEEDED).exists()
