"""A writer whose host's clock is wrong, for the clock tests (run under
libfaketime: ``tests.processes.spawn(..., clock="-120s")``)::

    python -m tests.clock_writer

In one transaction it publishes an ``OrderPlaced`` expiring a minute from
now (order 1), one due a minute from now (order 2) and enqueues a task with
``countdown=60, expires=120``; then it tries an event expiring a minute
after its own clock's now. Prints one JSON line: the ids written by name,
and the message of the exception the last publish raised (or null).
"""

import datetime
import decimal
import json
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

import django

django.setup()

from celery import signature  # noqa: E402
from django.db import transaction  # noqa: E402
from django.utils import timezone  # noqa: E402

from outbox_app import enqueue, publish  # noqa: E402
from outbox_app.exceptions import InvalidSchedule  # noqa: E402
from tests.testapp.events import OrderPlaced  # noqa: E402

MINUTE = datetime.timedelta(minutes=1)


def order(number: int) -> OrderPlaced:
    return OrderPlaced(order_id=number, total=decimal.Decimal(number))


def main() -> None:
    with transaction.atomic():
        [expiring] = publish(order(1), expires_at=MINUTE)
        [scheduled] = publish(order(2), deliver_at=MINUTE)
        task = enqueue(
            signature("tests.record_task", args=("/dev/null", 1)).set(
                countdown=60, expires=120
            )
        )
    refused = None
    try:
        with transaction.atomic():
            publish(order(3), expires_at=timezone.now() + MINUTE)
    except InvalidSchedule as exc:
        refused = str(exc)
    written = {"expiring": expiring, "scheduled": scheduled, "task": task}
    print(
        json.dumps({**{k: str(e.id) for k, e in written.items()}, "refused": refused})
    )


if __name__ == "__main__":
    main()
