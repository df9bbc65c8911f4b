"""Found by outbox_app's autodiscovery of each installed app's ``consumers``:
``manage.py consume`` (one process, started by the soak) runs it on the
queue ``soak.inbox``, bound to the relays' exchange.

- ``soak.consumer``: writes an ``Effect`` row in the inbox's transaction: once
  per event, however many copies the broker delivers.

The soak also sends poison messages straight to ``soak.inbox`` (not
CloudEvents, or with ids no column can store): each must be dead-lettered as
undecodable while the rest flows on.
"""

import os

from outbox_app import consumer
from outbox_app.store.clock import database_now

from .events import Deposited
from .models import Effect

QUEUE = "soak.inbox"
PID = os.getpid()


@consumer(Deposited, queue=QUEUE, name="soak.consumer")
def consume(event: Deposited, context) -> None:
    Effect.objects.create(
        handler="soak.consumer",
        event_id=context.event_id,
        aggregate=context.aggregate_id or "",
        position=context.aggregate_version,
        attempt=context.attempt,
        relay_pid=PID,
        at=database_now(),
    )
