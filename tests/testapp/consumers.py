"""Found by outbox_app's autodiscovery of each installed app's ``consumers``.

Registered only in ``manage.py consume`` processes the inbox tests start
(``OUTBOX_TEST_CONSUMER_QUEUE``), those of ``OUTBOX_TEST_CONSUMERS``
(comma-separated; default ``tests.inbox``), so two processes can run two
versions of the code:

* ``tests.inbox`` records each OrderPlaced as a SideEffect; with
  ``OUTBOX_TEST_CONSUMER_HANG`` (a file path) it creates that file after its
  write and sleeps, uncommitted, until the test kills the process (or for
  ``OUTBOX_TEST_CONSUMER_HANG_SECONDS``); an order id in
  ``OUTBOX_TEST_CONSUMER_POISON`` always fails (two attempts, then DEAD),
  one in ``OUTBOX_TEST_CONSUMER_GARBLED`` always fails with a lone surrogate
  and a NUL character in its error. Each message also registers an
  ``on_commit`` callback recording a ``tests.inbox.after`` SideEffect; for an
  order id in ``OUTBOX_TEST_CONSUMER_CALLBACK_FAILS`` that callback raises on
  the message's first attempt.
* ``tests.audit`` records each OrderPlaced and each ``ParcelSent`` (a type no
  Event class defines) as a ``tests.audit`` SideEffect.
"""

import os
import pathlib
import time

from django.db import transaction

from outbox_app import consumer

from .events import OrderPlaced
from .models import SideEffect

QUEUE = os.environ.get("OUTBOX_TEST_CONSUMER_QUEUE")
CONSUMERS = os.environ.get("OUTBOX_TEST_CONSUMERS", "tests.inbox").split(",")


def _order(name: str) -> int:
    return int(os.environ.get(name, "-1"))


if QUEUE and "tests.inbox" in CONSUMERS:
    POISON = _order("OUTBOX_TEST_CONSUMER_POISON")
    GARBLED = _order("OUTBOX_TEST_CONSUMER_GARBLED")
    CALLBACK_FAILS = _order("OUTBOX_TEST_CONSUMER_CALLBACK_FAILS")

    @consumer(OrderPlaced, queue=QUEUE, name="tests.inbox", max_attempts=2)
    def record(event: OrderPlaced, context) -> None:
        if event.order_id == POISON:
            raise ValueError(f"order {POISON} is poison")
        if event.order_id == GARBLED:
            raise ValueError(f"order {GARBLED} is \udcff\x00 garbled")
        effect = {"handler": "tests.inbox", "event_id": context.event_id}
        if event.order_id == CALLBACK_FAILS:
            # Runs again after its callback failed: idempotent, as a consumer
            # with on_commit side effects must be.
            SideEffect.objects.get_or_create(**effect, position=event.order_id)
        else:
            SideEffect.objects.create(**effect, position=event.order_id)

        def after(n=event.order_id, attempt=context.attempt) -> None:
            if n == CALLBACK_FAILS and attempt == 1:
                raise RuntimeError(f"the callback of order {n} failed")
            SideEffect.objects.create(
                handler="tests.inbox.after", event_id=context.event_id, position=n
            )

        transaction.on_commit(after)
        hang = os.environ.get("OUTBOX_TEST_CONSUMER_HANG")
        if hang:
            pathlib.Path(hang).touch()
            time.sleep(float(os.environ.get("OUTBOX_TEST_CONSUMER_HANG_SECONDS", 120)))


if QUEUE and "tests.audit" in CONSUMERS:

    @consumer(OrderPlaced, "ParcelSent", queue=QUEUE, name="tests.audit")
    def audit(event, context) -> None:
        SideEffect.objects.create(
            handler="tests.audit",
            event_id=context.event_id,
            position=context.payload["order_id"],
            aggregate=context.event_type,
        )
