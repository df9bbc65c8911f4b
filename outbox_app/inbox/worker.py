"""``manage.py consume``'s loop: read the consumers' queues through kombu,
acknowledge each message after its inbox transaction committed, and retry
the failed ones from the database between batches.

The messages the broker has sent (up to the prefetch) are handled as one batch
in one transaction (``receive_batch``): one SELECT for the duplicates, one
INSERT of the inbox rows and one COMMIT, the database's durable write, for
the whole batch (docs/consumers.md, "Throughput"). A crash
before the COMMIT leaves every message of the batch unacknowledged: the broker
delivers them again.

Each queue is declared durable and bound to ``OUTBOX_INBOX_EXCHANGE`` with its
consumers' bindings. The broker sends up to ``OUTBOX_INBOX_PREFETCH`` messages
ahead of the acks (RabbitMQ ``basic.qos``; kombu's Redis transport keeps that
many unacked). A database error leaves the message unacknowledged and handed
back (``requeue``), and the loop waits before the next one; a broker that is
unreachable (at start too) or drops the connection is retried with a capped
backoff, one log line per attempt. SIGTERM/SIGINT (``stop``) finishes the
message in hand and returns.

Before it consumes, and every ``HEARTBEAT_SECONDS``, the process records its
consumers (:func:`~outbox_app.inbox.recorded.record`), so that processes of
another version keep the messages of consumers they lack.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Sequence

from django.db import DatabaseError, connections, router
from kombu import Connection, Exchange, Queue, binding
from kombu.exceptions import OperationalError

from ..conf import mask_url, outbox_settings
from ..execution.metrics import consume_metrics
from ..execution.retry import RECONNECT
from ..health import HealthFile
from ..store.models import InboxMessage
from ..store.querysets import HEARTBEAT_SECONDS
from . import recorded
from .outcomes import Tally
from .receive import receive_batch
from .registry import Consumer
from .retry import retry_due

logger = logging.getLogger("outbox_app.inbox")

#: Seconds between looks for failed messages due again.
RETRY_EVERY = 1.0
#: How long a batch waits for one more message the broker is sending, seconds.
GATHER_SECONDS = 0.001


class ConsumeWorker:
    """Consume until stopped.

    Args:
        consumers: whom to run (those of the queues to read).
        url: kombu URL; default ``OUTBOX_INBOX_URL``.
        prefetch: messages in flight; default ``OUTBOX_INBOX_PREFETCH``.
        idle_exit: return after this many seconds without a message and with
            no retry due (``None``: never).
        max_seconds: return after this long (``None``: never).
        stop: set to return after the message in hand.
        health: the health file to rewrite each loop turn
            (:mod:`outbox_app.health`): ready when the broker is connected and
            the database answered on the last turn; removed when ``run``
            returns.
    """

    def __init__(
        self,
        consumers: Sequence[Consumer],
        *,
        url: str | None = None,
        prefetch: int | None = None,
        idle_exit: float | None = None,
        max_seconds: float | None = None,
        stop: threading.Event | None = None,
        health: HealthFile | None = None,
    ):
        self.consumers = list(consumers)
        self.url = url or outbox_settings.INBOX_URL
        self.prefetch = prefetch or outbox_settings.INBOX_PREFETCH
        self.idle_exit = idle_exit
        self.max_seconds = max_seconds
        self.stop = stop or threading.Event()
        self.health = health
        self.tally = Tally()
        self.by_queue: dict[str, list[Consumer]] = defaultdict(list)
        for consumer in self.consumers:
            self.by_queue[consumer.queue].append(consumer)
        self.alias = router.db_for_write(InboxMessage)
        self._last_message = time.monotonic()
        self._database_failures = 0
        self._broker_failures = 0
        self._recorded_at: float | None = None
        self._pending: list[tuple[str, object]] = []
        #: The last database error, until a query succeeds again.
        self._database_error: str | None = None

    def queues(self) -> list[Queue]:
        """The kombu queues: durable, bound with every binding their
        consumers ask for."""
        exchange = Exchange(
            outbox_settings.INBOX_EXCHANGE,
            outbox_settings.INBOX_EXCHANGE_TYPE,
            durable=True,
        )
        found = []
        for name, consumers in self.by_queue.items():
            keys = sorted({key for c in consumers for key in c.bindings})
            found.append(
                Queue(
                    name,
                    exchange=exchange,
                    bindings=[binding(exchange, routing_key=key) for key in keys],
                    durable=True,
                )
            )
        return found

    def run(self) -> Tally:
        """Consume until ``stop``, ``idle_exit`` or ``max_seconds``.

        Returns:
            The counts of this run.
        """
        started = time.monotonic()
        # OperationalError: kombu's wrapping of a connection refused while
        # connecting (ensure_connection).
        broker_errors = (
            OSError,
            OperationalError,
            *Connection(self.url).connection_errors,
        )
        try:
            while not self._done(started):
                if not self._record():
                    continue
                try:
                    with Connection(self.url) as connection:
                        self._consume(connection, started)
                    break
                except broker_errors as exc:
                    # Unacknowledged on a lost connection: the broker sends
                    # them again.
                    self._pending = []
                    self._broker_failures += 1
                    delay = RECONNECT.delay(self._broker_failures)
                    reason = mask_url(str(exc))
                    logger.error(
                        "consume: broker unreachable (attempt %d: %s), "
                        "reconnecting in %.1f s",
                        self._broker_failures,
                        reason,
                        delay,
                    )
                    self._wait(delay, f"broker unreachable: {reason}")
        finally:
            if self.health is not None:
                self.health.remove()
        logger.info("consume stopped: %s", self.tally)
        return self.tally

    def _wait(self, seconds: float, why: str) -> None:
        """A reconnect's backoff: not ready for ``why``, alive meanwhile."""
        if self.health is None:
            self.stop.wait(seconds)
            return
        self.health.report(False, why)
        self.health.wait(self.stop, seconds)

    def _report_health(self) -> None:
        """One turn with the broker connected: ready unless the database
        failed on its last query."""
        if self.health is not None:
            error = self._database_error
            self.health.report(error is None, f"database error: {error}")

    def _record(self) -> bool:
        """Record this process's consumers when due (first, then every
        ``HEARTBEAT_SECONDS``). False when the database failed (logged; the
        loop waits)."""
        now = time.monotonic()
        if (
            self._recorded_at is not None
            and now - self._recorded_at < HEARTBEAT_SECONDS
        ):
            return True
        try:
            recorded.record(self.consumers, self.alias)
        except DatabaseError as exc:
            self._database_down(exc)
            return False
        self._recorded_at = now
        self._database_error = None
        return True

    def _consume(self, connection: Connection, started: float) -> None:
        connection.ensure_connection(max_retries=1)
        channel = connection.channel()
        kombu_consumers = [
            connection.Consumer(
                [queue],
                channel=channel,
                on_message=self._handler(queue.name),
                prefetch_count=self.prefetch,
            )
            for queue in self.queues()
        ]
        for kombu_consumer in kombu_consumers:
            kombu_consumer.consume()
        self._broker_failures = 0
        logger.info(
            "consume ready: queues %s on %s, prefetch %d, consumers %s",
            ", ".join(self.by_queue),
            mask_url(self.url),
            self.prefetch,
            ", ".join(c.name for c in self.consumers),
        )
        next_retry = 0.0
        try:
            while not self._done(started):
                self._report_health()
                with contextlib.suppress(TimeoutError):
                    connection.drain_events(timeout=min(RETRY_EVERY, 0.5))
                    # What else the broker has sent already joins the batch.
                    while len(self._pending) < self.prefetch:
                        connection.drain_events(timeout=GATHER_SECONDS)
                if self._pending:
                    self._process()
                if time.monotonic() >= next_retry:
                    next_retry = time.monotonic() + RETRY_EVERY
                    self._retry()
                    self._record()
        finally:
            for kombu_consumer in kombu_consumers:
                kombu_consumer.cancel()

    def _handler(self, queue: str):
        def on_message(message) -> None:
            self._pending.append((queue, message))

        return on_message

    def _process(self) -> None:
        """The messages received so far, in one transaction
        (:func:`~outbox_app.inbox.receive.receive_batch`), then the acks. A
        database error hands every message back."""
        batch, self._pending = self._pending, []
        self._last_message = time.monotonic()
        consume_metrics.received(queue for queue, _ in batch)
        try:
            tally = receive_batch(
                [
                    (message.body, queue, message.properties.get("message_id"))
                    for queue, message in batch
                ],
                self.by_queue,
                using=self.alias,
            )
        except DatabaseError as exc:
            for _, message in batch:
                message.requeue()
            self._database_down(exc)
            return
        for _, message in batch:
            message.ack()
        self._database_failures = 0
        self._database_error = None
        self.tally += tally
        logger.debug("consume batch messages=%d %s", len(batch), tally.fields())

    def _retry(self) -> None:
        try:
            tally = retry_due(self.consumers, using=self.alias)
        except DatabaseError as exc:
            self._database_down(exc)
            return
        self._database_error = None
        if tally.handled or tally.failed or tally.dead:
            self._last_message = time.monotonic()
            logger.debug("consume retries %s", tally.fields())
        self.tally += tally

    def _database_down(self, exc: Exception) -> None:
        self._database_failures += 1
        delay = RECONNECT.delay(self._database_failures)
        logger.error(
            "consume: database error (%s); messages handed back, waiting %.1f s",
            exc,
            delay,
        )
        connections[self.alias].close()
        self._database_error = str(exc)
        self._wait(delay, f"database error: {exc}")

    def _done(self, started: float) -> bool:
        now = time.monotonic()
        if self.stop.is_set():
            return True
        if self.max_seconds is not None and now - started >= self.max_seconds:
            return True
        return self.idle_exit is not None and now - self._last_message >= self.idle_exit
