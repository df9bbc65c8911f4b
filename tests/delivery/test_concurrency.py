"""Relays claiming side by side on one database: a deadlock the database
breaks (InnoDB picks a victim among concurrent skip-locked claims) costs a
retry, not the relay's iteration."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connections, transaction
from django.test import skipUnlessDBFeature

from outbox_app import Delivery, publish
from outbox_app.models import Subscription
from outbox_app.relay.batch import Batch
from outbox_app.relay.fanout import fan_out
from outbox_app.relay.registry import get
from outbox_app.store.lifecycle import State
from outbox_app.subscribers import Handler
from tests.testapp.events import Step

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.mark.engine("rows")  # claims of rows side by side
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
                    batch.token, [c.delivery_id for c in batch.contexts], batch.now
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
    assert Delivery.objects.filter(state=State.SUCCEEDED).exists()


@pytest.mark.only_database("postgresql", "mysql")  # SQLite: one writer, no deadlock
def test_a_relay_recording_its_subscriptions_is_reissued_as_a_deadlock_victim():
    # Relays starting side by side insert the same subscription rows; once one
    # died at start-up as InnoDB's deadlock victim. Here another transaction
    # inserts "b", waits until the recording (a, then b) holds "a" and waits
    # for "b", then inserts "a" too. It has written more, so the database
    # rolls the recording back (InnoDB by weight, PostgreSQL's first waiter by
    # deadlock_timeout): the recording must run again, not fail.
    a, b = (Handler(name=name, event_types=None) for name in ("a", "b"))
    other_inserted_b = threading.Event()
    errors: list[BaseException] = []

    def other() -> None:
        try:
            with transaction.atomic():
                for n in range(20):
                    Subscription.objects.create(subscriber=f"c{n}", event_type="*")
                Subscription.objects.create(subscriber="b", event_type="*")
                other_inserted_b.set()
                # By now the recording waits for "b", holding "a"; PostgreSQL
                # checks a waiter for deadlock once, deadlock_timeout (1 s)
                # after it began to wait: the recording's check must come
                # after this insert closes the cycle.
                time.sleep(0.5)
                Subscription.objects.create(subscriber="a", event_type="*")
        except BaseException as exc:
            errors.append(exc)
        finally:
            connections["default"].close()

    thread = threading.Thread(target=other)
    thread.start()
    assert other_inserted_b.wait(30)
    Subscription.objects.record([a, b], "w:1")
    thread.join(60)
    assert not errors, errors
    assert Subscription.objects.filter(subscriber__in=["a", "b"]).count() == 2
