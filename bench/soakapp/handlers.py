"""Found by outbox_app's autodiscovery of each installed app's ``handlers``.

Three database-only handlers of ``Deposited``, each writing one ``Effect`` row
(stamped with the database's clock) in the transaction that delivers it
(marks its row SUCCEEDED, or moves its cursor past it), then sleeping a
random time from 0 to twice ``$SOAK_HANDLER_SECONDS`` (default 0.002 s) with
that transaction open:

- ``soak.effect``: writes its row.
- ``soak.flaky``: writes its row, then raises ``ConnectionError`` with the
  probability ``$SOAK_FAILURE_RATE`` (default 0.05), which rolls the row back
  and retries the delivery with backoff.
- ``soak.ordered`` (``ordered=True``): reads the highest position of its
  aggregate's effects committed so far, writes its row with it
  (``previous``), then fails like ``soak.flaky`` at half the rate (a failing
  head holds its aggregate back until the retry).

Half of the failures' messages hold a lone surrogate (``"\\udcff"``), text
no database column can store as it is: the relay must record the failure
all the same.

One more handler has an effect outside its transaction:

- ``soak.callback``: registers a ``transaction.on_commit`` callback that
  sends the event (a ``Sent`` row, idempotent by its unique key) after the
  handler's commit, and raises instead with the probability
  ``$SOAK_CALLBACK_FAILURE_RATE`` (default 0.05): that attempt fails and the
  handler runs again; the other handlers' callbacks and rows are unaffected.
"""

import contextlib
import os
import random
import time

from django.db import IntegrityError, transaction
from django.db.models import Max

from outbox_app import handler
from outbox_app.store.clock import database_now

from .events import Deposited
from .models import Effect, Sent

FAILURE_RATE = float(os.environ.get("SOAK_FAILURE_RATE", "0.05"))
HANDLER_SECONDS = float(os.environ.get("SOAK_HANDLER_SECONDS", "0.002"))
CALLBACK_FAILURE_RATE = float(os.environ.get("SOAK_CALLBACK_FAILURE_RATE", "0.05"))
PID = os.getpid()


def _record(name: str, event: Deposited, context, previous: int | None = None):
    Effect.objects.create(
        handler=name,
        event_id=context.event_id,
        aggregate=context.aggregate_id or "",
        position=context.aggregate_version,
        previous=previous,
        attempt=context.attempt,
        relay_pid=PID,
        at=database_now(),
    )
    time.sleep(random.uniform(0, 2 * HANDLER_SECONDS))


@handler(Deposited, name="soak.effect")
def effect(event: Deposited, context) -> None:
    _record("soak.effect", event, context)


@handler(Deposited, name="soak.flaky")
def flaky(event: Deposited, context) -> None:
    _record("soak.flaky", event, context)
    if random.random() < FAILURE_RATE:
        raise ConnectionError(_failure("soak.flaky", context))


@handler(Deposited, name="soak.ordered", ordered=True)
def ordered(event: Deposited, context) -> None:
    seen = Effect.objects.filter(
        handler="soak.ordered", aggregate=context.aggregate_id or ""
    ).aggregate(top=Max("position"))["top"]
    _record("soak.ordered", event, context, previous=seen or 0)
    if random.random() < FAILURE_RATE / 2:
        raise ConnectionError(_failure("soak.ordered", context))


def _failure(name: str, context) -> str:
    """A failure's message; half of them unstorable as they are."""
    text = f"{name} failed on attempt {context.attempt}"
    return text + " \udcff" if random.random() < 0.5 else text


@handler(Deposited, name="soak.callback")
def callback(event: Deposited, context) -> None:
    def send() -> None:
        if random.random() < CALLBACK_FAILURE_RATE:
            raise ConnectionError(_failure("soak.callback's on_commit", context))
        # Sent already when a relay ran it before its lease ran out.
        with contextlib.suppress(IntegrityError):
            Sent.objects.create(
                event_id=context.event_id, attempt=context.attempt, at=database_now()
            )

    transaction.on_commit(send)
