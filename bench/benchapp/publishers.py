"""A ``KombuPublisher`` that records when each message is confirmed."""

import os
import time

from outbox_app.publishers.kombu import KombuPublisher


class ConfirmTimes(KombuPublisher):
    """Appends ``<event id> <time.time()>`` to ``$BENCH_CONFIRM_FILE`` for each
    message of a batch the broker confirmed, as soon as ``collect()`` returns
    (the relay's confirm window: the batch is sent, the next one may be sent
    before this one is collected). Configure it as ``BACKEND`` in
    ``OUTBOX_PUBLISHERS``."""

    def send(self, messages):
        sent = super().send(messages)
        sent.bench_ids = [str(m.event_id) for m in messages]
        return sent

    def collect(self, sent):
        outcomes = super().collect(sent)
        confirmed = time.time()
        with open(os.environ["BENCH_CONFIRM_FILE"], "a") as out:
            for event_id, outcome in zip(sent.bench_ids, outcomes, strict=True):
                if outcome is None:
                    out.write(f"{event_id} {confirmed}\n")
        return outcomes
