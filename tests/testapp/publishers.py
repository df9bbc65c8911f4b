"""Publishers for the crash tests, configured as ``BACKEND`` in relay processes."""

from __future__ import annotations

import os
import signal
from collections import Counter

from outbox_app.publishers.celery import CeleryPublisher
from outbox_app.publishers.kafka import KafkaPublisher
from outbox_app.publishers.kombu import KombuPublisher
from outbox_app.publishers.nats import JetStreamPublisher


class Killing:
    """A publisher mixin whose process SIGKILLs itself at one point of the
    confirm window: ``OUTBOX_TEST_KILL_AT=<send|collect>:<n>:<before|after>``
    (the n-th call of that method, before or after it runs)."""

    calls: Counter = Counter()

    def send(self, messages):
        self._kill_at("send", "before")
        handle = super().send(messages)
        self._kill_at("send", "after")
        return handle

    def collect(self, sent):
        self._kill_at("collect", "before")
        outcomes = super().collect(sent)
        self._kill_at("collect", "after")
        return outcomes

    def _kill_at(self, method: str, moment: str) -> None:
        if moment == "before":
            self.calls[method] += 1
        point = f"{method}:{self.calls[method]}:{moment}"
        if os.environ.get("OUTBOX_TEST_KILL_AT") == point:
            os.kill(os.getpid(), signal.SIGKILL)


class KillingPublisher(Killing, KombuPublisher):
    """A KombuPublisher killed at ``OUTBOX_TEST_KILL_AT``."""


class KillingJetStreamPublisher(Killing, JetStreamPublisher):
    """A JetStreamPublisher killed at ``OUTBOX_TEST_KILL_AT``."""


class KillingCeleryPublisher(Killing, CeleryPublisher):
    pass


class KillingKafkaPublisher(Killing, KafkaPublisher):
    """A KafkaPublisher killed at ``OUTBOX_TEST_KILL_AT``."""
