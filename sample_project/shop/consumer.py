"""The other end of the pipe: consume the shop's integration events from the
broker, deduplicated by ``message_id`` (at-least-once in, effectively once out)."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

from django.conf import settings
from django.db import IntegrityError, transaction
from kombu import Connection, Exchange, Queue

from .models import ConsumedMessage


@dataclass
class ConsumeReport:
    """Counts of one consumer run: ``consumed`` new messages, ``duplicates``
    (redeliveries dropped by the dedup table)."""

    consumed: int = 0
    duplicates: int = 0


class EventConsumer:
    """Consume ``SHOP_EVENTS_QUEUE`` (bound to ``SHOP_EVENTS_EXCHANGE`` with ``#``)
    on ``OUTBOX_BROKER_URL``; record each message in ConsumedMessage, then ack."""

    def __init__(self) -> None:
        self.report = ConsumeReport()
        exchange = Exchange(settings.SHOP_EVENTS_EXCHANGE, "topic", durable=True)
        self.queue = Queue(
            settings.SHOP_EVENTS_QUEUE, exchange, routing_key="#", durable=True
        )

    def run(
        self,
        *,
        idle_seconds: float | None = None,
        max_seconds: float | None = None,
        stop: threading.Event | None = None,
    ) -> ConsumeReport:
        """Consume until ``stop`` is set, nothing arrived for ``idle_seconds``, or
        ``max_seconds`` passed (``None``: no such limit).

        Returns:
            ConsumeReport of this run.

        Raises:
            kombu/amqp connection errors once kombu's own retries give up.
        """
        started = last = time.monotonic()
        connection = Connection(settings.SHOP_BROKER_URL)
        consumer = connection.Consumer(
            self.queue, on_message=self._on_message, prefetch_count=200
        )
        with connection, consumer:
            while not (stop is not None and stop.is_set()):
                now = time.monotonic()
                if max_seconds is not None and now - started >= max_seconds:
                    break
                if idle_seconds is not None and now - last >= idle_seconds:
                    break
                try:
                    connection.drain_events(timeout=0.2)
                except TimeoutError:
                    continue
                last = time.monotonic()
        return self.report

    def _on_message(self, message) -> None:
        message_id = message.properties.get("message_id") or ""
        event_type = json.loads(message.body).get("type", "")
        try:
            with transaction.atomic():
                ConsumedMessage.objects.create(
                    message_id=message_id, event_type=event_type
                )
        except IntegrityError:
            self.report.duplicates += 1
        else:
            self.report.consumed += 1
        message.ack()
