"""Recording what happened to a claimed batch: one place writes outcomes,
counts them and logs them.

Every write is compare-and-set on the batch's lease token (the gateway's
``succeed``, ``fail``, ``release``), so a relay that lost its lease writes
nothing; the rows it no longer holds are counted as ``lost``. Saving an
outcome is kept apart from logging it; log records carry structured
``extra`` fields (``subscriber``, ``delivery_id``, ``event_id``,
``attempt``) for log pipelines.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from django.db import DatabaseError

from ..exceptions import EventExpired, LeaseLost
from ..execution.metrics import Counts, relay_metrics
from ..execution.run import recorded_error
from ..store.gateway import Gateway
from ..subscribers import DeliveryContext, Subscriber, dotted_path

logger = logging.getLogger("outbox_app.relay")


#: The error type and text recorded on a row skipped because its event
#: expired.
LAPSED_ERROR_TYPE = dotted_path(EventExpired)
LAPSED_ERROR = "the event's expires_at passed before it was delivered"


@dataclass
class RelayReport(Counts):
    """Counts of one relay call (rows, not events).

    Attributes:
        fanned_out: events turned into deliveries.
        claimed: deliveries leased.
        succeeded, failed, dead: outcomes written (FAILED will be retried).
        lapsed: SKIPPED unattempted, their event expired (``expires_at``)
            before delivery.
        lost: outcomes discarded because the lease had passed to another worker.
        released: claimed rows handed back unattempted (shutdown, time up, a
            publisher paused by an outage); their attempt is not counted.
    """

    fanned_out: int = 0
    claimed: int = 0
    succeeded: int = 0
    failed: int = 0
    dead: int = 0
    lapsed: int = 0
    lost: int = 0
    released: int = 0


class Outcomes:
    """Writes the outcomes of one claimed batch and counts them in ``report``.

    Args:
        gateway: the statements of the batch's database.
        subscriber: whose batch it is (for messages).
        token: the batch's lease token.
        report: where the counts go.
    """

    def __init__(
        self, gateway: Gateway, subscriber: Subscriber, token, report: RelayReport
    ):
        self.gateway = gateway
        self.subscriber = subscriber
        self.token = token
        self.report = report

    def now(self) -> datetime.datetime:
        """The time outcomes are stamped with: the gateway's (the database's
        clock)."""
        return self.gateway.now()

    def succeeded(
        self, contexts: Sequence[DeliveryContext], *, all_or_none: bool = False
    ) -> int:
        """Mark the rows of ``contexts`` SUCCEEDED; the rows no longer held
        count as lost. Each delivered row's latency (publish to this mark) is
        observed, unless a lease was lost: which rows were written is not
        known then, and the relay that has the others observes them. Returns
        rows written.

        Raises:
            LeaseLost: with ``all_or_none``, when a row was no longer held
                (nothing is counted: the caller rolls the write back).
        """
        if not contexts:
            return 0
        ids = [c.delivery_id for c in contexts]
        now = self.now()
        written = self.gateway.succeed(self.token, ids, now)
        if all_or_none and written < len(ids):
            raise LeaseLost(f"{len(ids) - written} of {len(ids)} leases lost")
        if written == len(ids):
            self.delivered(contexts, now)
        else:
            self.report.succeeded += written
            relay_metrics.outcome(self.subscriber.name, "succeeded", written)
            self.lost(len(ids) - written, "was delivered")
        return written

    def delivered(
        self, contexts: Sequence[DeliveryContext], now: datetime.datetime
    ) -> None:
        """Count ``contexts`` delivered at ``now`` (their outcome is written)
        and observe each one's latency, publish (or scheduled time) to
        ``now``."""
        self.report.succeeded += len(contexts)
        name = self.subscriber.name
        relay_metrics.outcome(name, "succeeded", len(contexts))
        relay_metrics.latency(
            name, (c.deliver_at or c.occurred_at for c in contexts), now
        )

    def failed(
        self,
        context: DeliveryContext,
        error: BaseException,
        retry_at: datetime.datetime | None,
    ) -> None:
        """Record a failed attempt: FAILED due at ``retry_at``, or DEAD (the
        dead letter) when ``retry_at`` is None. A database error while recording
        leaves the row RUNNING until its lease runs out (it is retried then) and
        is logged; the rest of the batch goes on."""
        message, error_type, text = recorded_error(error)
        try:
            written = self.gateway.fail(
                self.token,
                context.delivery_id,
                error=message,
                error_type=error_type,
                traceback=text,
                retry_at=retry_at,
                now=self.now(),
            )
        except DatabaseError:
            logger.exception(
                "%s: could not record the failure of delivery %s: %s",
                self.subscriber.name,
                context.delivery_id,
                error,
                extra=_extra(self.subscriber, context),
            )
            return
        if not written:
            self.lost(1, "failed")
            return
        self.failure(context, error, retry_at, error_type)

    def failure(
        self,
        context: DeliveryContext,
        error: BaseException,
        retry_at: datetime.datetime | None,
        error_type: str,
    ) -> None:
        """Count and log a failed attempt whose outcome is written: FAILED
        due at ``retry_at``, or DEAD when it is None."""
        relay_metrics.failure(self.subscriber.name, error_type)
        if retry_at is None:
            self.report.dead += 1
            relay_metrics.outcome(self.subscriber.name, "dead", 1)
            logger.error(
                "%s: delivery %s of event %s DEAD after %d attempt(s): %s",
                self.subscriber.name,
                context.delivery_id,
                context.event_id,
                context.attempt,
                error,
                extra=_extra(self.subscriber, context),
            )
        else:
            self.report.failed += 1
            relay_metrics.outcome(self.subscriber.name, "failed", 1)
            logger.warning(
                "%s: delivery %s of event %s failed (attempt %d), retry at %s: %s",
                self.subscriber.name,
                context.delivery_id,
                context.event_id,
                context.attempt,
                retry_at.isoformat(),
                error,
                extra=_extra(self.subscriber, context),
            )

    def lapsed(self, contexts: Sequence[DeliveryContext]) -> int:
        """Skip ``contexts`` unattempted: their event expired before delivery
        (``publish(expires_at=...)``). Recorded as SKIPPED with the error type
        ``EventExpired``. Returns rows written; the others count as lost."""
        if not contexts:
            return 0
        written = self.gateway.lapse(
            self.token,
            [c.delivery_id for c in contexts],
            error=LAPSED_ERROR,
            error_type=LAPSED_ERROR_TYPE,
            now=self.now(),
        )
        self.skipped(written)
        self.lost(len(contexts) - written, "expired")
        return written

    def skipped(self, count: int) -> None:
        """Count and log ``count`` deliveries skipped unattempted, their event
        expired (their outcome is written)."""
        if not count:
            return
        self.report.lapsed += count
        relay_metrics.outcome(self.subscriber.name, "lapsed", count)
        logger.info(
            "%s: %d delivery(s) skipped, their event expired before delivery",
            self.subscriber.name,
            count,
            extra={"subscriber": self.subscriber.name},
        )

    def released(self, ids: Sequence[int], due: datetime.datetime | None = None) -> int:
        """Hand ``ids`` back unattempted, due at ``due`` (default now). Returns
        rows released; the others are no longer this batch's."""
        released = self.gateway.release(self.token, ids, self.now(), due)
        self.handed_back(released)
        return released

    def handed_back(self, count: int) -> None:
        """Count ``count`` deliveries handed back unattempted (their rows
        released, or a stream's cursor left before them)."""
        self.report.released += count
        relay_metrics.outcome(self.subscriber.name, "released", count)

    def lost(self, count: int, what: str = "ran") -> None:
        """``count`` rows turned out to be another relay's (their lease ran
        out and it claimed them): their outcome is discarded."""
        if not count:
            return
        self.report.lost += count
        relay_metrics.outcome(self.subscriber.name, "lost", count)
        logger.warning(
            "%s: %d delivery(s) %s after their lease had passed to another "
            "relay; the outcome was discarded (at least once: that relay "
            "delivers them)",
            self.subscriber.name,
            count,
            what,
            extra={"subscriber": self.subscriber.name},
        )


def _extra(subscriber: Subscriber, context: DeliveryContext) -> dict:
    return {
        "subscriber": subscriber.name,
        "delivery_id": context.delivery_id,
        "event_id": str(context.event_id),
        "attempt": context.attempt,
    }
