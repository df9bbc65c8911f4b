"""Delivering claimed batches to a broker publisher: a confirm window across
batches, and outages that pause the publisher instead of spending attempts.

**Confirm window.** The runner sends batch N+1 before it collects batch N's
confirms (:meth:`Publisher.send`, :meth:`Publisher.collect`), so one batch is
on the wire while the previous one's confirms arrive and its rows are marked.
Nothing is marked SUCCEEDED before the broker confirmed it; a relay killed at
any point of the window leaves the unmarked rows RUNNING until their lease
runs out, and another relay sends them again (at least once: the duplicates
are the unconfirmed batches). An ordered publisher's next batch holds only
aggregates with nothing in flight (the claim takes heads only), so the window
keeps per-aggregate order.

**Outages.** A failure of the transport itself
(:class:`~outbox_app.exceptions.PublisherUnavailable`: connection refused or
reset, channel closed, confirm timeout; or an ``OSError`` a backend raises) is
a property of the destination, not of the messages. Their rows are handed back
with no attempt counted, and the publisher is paused as a whole: no claims for
it until a probe (:meth:`Publisher.probe`) succeeds, tried after a capped,
jittered backoff (``OUTBOX_PAUSE_MAX_SECONDS``). The first batch after a
passing probe settles it: the publisher resumes once that batch reaches the
destination, and the batch's outage counts as a failed probe (a publisher
without a probe of its own is probed by that batch alone), so the backoff
holds for every publisher. One line is logged when it pauses and one when it
resumes; ``outbox_status`` and the admin overview show
the pause (:class:`~outbox_app.store.models.SubscriberPause`). An outage of any
length ends with every event delivered and none DEAD. Per-message outcomes
(a nack, an unroutable message) count as attempts and follow the retry policy;
a message that can never be sent
(:class:`~outbox_app.exceptions.UndeliverableMessage`) goes to the dead letter at once.
"""

from __future__ import annotations

import datetime
import logging
import random
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from django.db import DatabaseError

from ..conf import mask_url, outbox_settings
from ..exceptions import DeliveryError, PublisherUnavailable
from ..execution import tracing
from ..execution.metrics import relay_metrics
from ..execution.retry import Backoff, RetryPolicy
from ..publishers.base import Publisher
from ..subscribers import DeliveryContext
from .batch import Batch, Sidecar
from .outcomes import Outcomes, RelayReport
from .stream import StreamBatch

logger = logging.getLogger("outbox_app.relay")


class PublisherRunner:
    """Delivers one publisher's batches for one :func:`deliver` call, keeping
    at most one batch in flight between calls of :meth:`deliver`.

    The SUCCEEDED marks of confirmed batches are written on a second
    connection (a :class:`~outbox_app.relay.batch.Sidecar`) while the next
    batch is sent, where one helps; :meth:`close` waits for them.
    """

    def __init__(
        self, publisher: Publisher, using: str, rng: random.Random | None = None
    ):
        self.publisher = publisher
        self.rng = rng
        self.policy = RetryPolicy.of(publisher)
        self.in_flight: _Sent | None = None
        self.sent_in_turn = False
        self.marks = Sidecar(using, "outbox-mark")
        self.marking: list[tuple[Future, RelayReport, RelayReport]] = []

    def deliver(
        self, batch: Batch | StreamBatch, report: RelayReport, *, last: bool
    ) -> None:
        """Send ``batch``, then collect and record the batch sent before it.
        ``last``: no batch follows soon, so collect this one at once too.

        An ordered publisher's stream batch, which may hold several events of
        one aggregate, is sent in waves of at most one event per aggregate,
        each confirmed before the next (:meth:`_waves`)."""
        outcomes = batch.outcomes(report)
        settlement = batch.settlement(outcomes)
        claimed = batch.contexts
        contexts = batch.keep(claimed)
        outcomes.lost(len(claimed) - len(contexts), "were taken over")
        fresh = []
        for context in contexts:
            error = self.policy.lease_ran_out(context.attempt)
            if error is None:
                fresh.append(context)
            else:
                outcomes.failed(context, error, None)
        if isinstance(batch, StreamBatch) and self.publisher.ordered and fresh:
            self.finish()
            self._waves(batch, settlement, fresh)
            return
        sent = None
        if fresh or (isinstance(batch, StreamBatch) and not batch.hold.lost):
            handle = self._send(fresh) if fresh else []
            sent = _Sent(batch, settlement, fresh, handle, backlog=not last)
        self.finish()
        self.in_flight = sent
        if last:
            self.finish()
        if fresh:
            self.sent_in_turn = True

    def turn_done(self, now, using: str) -> None:
        """A subscriber's turn (its rows and its stream) ended: if nothing
        was sent in it, a probe that passed has the last word (the publisher
        on trial resumes)."""
        if not self.sent_in_turn:
            pauses.resume(self.publisher, now, using, sent=False)
        self.sent_in_turn = False

    def _send(self, contexts: list[DeliveryContext]) -> Any:
        """Put ``contexts`` on the wire (:meth:`Publisher.send`) in a span; a
        raised error becomes every message's outcome."""
        name = self.publisher.name
        try:
            with tracing.span(
                f"outbox publish {name}",
                producer=True,
                headers=(c.headers for c in contexts),
                attributes={
                    "messaging.system": "outbox_app",
                    "messaging.operation.type": "send",
                    "messaging.destination.name": name,
                    "messaging.batch.message_count": len(contexts),
                },
            ):
                return self.publisher.send(contexts)
        except Exception as exc:
            return _Raised(exc)

    def _waves(
        self, batch: StreamBatch, settlement, contexts: list[DeliveryContext]
    ) -> None:
        """Send an ordered publisher's stream batch in waves: each wave holds
        the next event of every aggregate still flowing (and every event
        without one), and is confirmed before the next is sent, so no event
        is on the wire while an earlier one of its aggregate may fail. An
        aggregate whose event failed or met an outage sends nothing more in
        this batch: its later events are set aside behind it."""
        waiting = list(contexts)
        results: dict[int, BaseException | None] = {}
        while waiting:
            wave, rest, seen = [], [], set()
            for context in waiting:
                key = (context.aggregate_type, context.aggregate_id)
                if context.aggregate_id is not None and key in seen:
                    rest.append(context)
                    continue
                seen.add(key)
                if settlement.skip(context):
                    continue
                wave.append(context)
            if not wave:
                break
            outcomes = self._collect(_Sent(batch, settlement, wave, self._send(wave)))
            for context, result in zip(wave, outcomes, strict=True):
                results[id(context)] = result
                if result is not None and context.aggregate_id is not None:
                    batch.held.add((context.aggregate_type, context.aggregate_id))
            outage = next(
                (r for r in outcomes if isinstance(r, PublisherUnavailable)), None
            )
            if outage is not None:
                # Nothing more is sent: what was not is taken back as the
                # outage's, so the cursor stays before it too.
                for context in rest:
                    results[id(context)] = outage
                break
            waiting = rest
        sent = [c for c in contexts if id(c) in results]
        self._record(
            _Sent(batch, settlement, sent, None),
            [results[id(c)] for c in sent],
        )

    def finish(self) -> None:
        """Collect and record the batch in flight, if any."""
        sent, self.in_flight = self.in_flight, None
        if sent is None:
            return
        self._record(sent, self._collect(sent))

    def _collect(self, sent: _Sent) -> list[BaseException | None]:
        """The outcome of each message of ``sent``, normalised."""
        if not sent.contexts:
            return []
        if isinstance(sent.handle, _Raised):
            results = [sent.handle.error] * len(sent.contexts)
        else:
            try:
                results = list(self.publisher.collect(sent.handle))
                if len(results) != len(sent.contexts):
                    raise RuntimeError(
                        f"{type(self.publisher).__name__} reported {len(results)} "
                        f"outcomes for {len(sent.contexts)} messages"
                    )
            except Exception as exc:
                results = [exc] * len(sent.contexts)
        return [self._normalise(r) for r in results]

    def _normalise(self, result: Any) -> BaseException | None:
        if result is None:
            return None
        if isinstance(result, OSError):  # a refused or reset connection
            error = PublisherUnavailable(f"{type(result).__name__}: {result}")
            error.__cause__ = result
            return error
        if isinstance(result, BaseException):
            return result
        return DeliveryError(f"{type(self.publisher).__name__} reported {result!r}")

    def _record(self, sent: _Sent, results: list[BaseException | None]) -> None:
        batch = sent.batch
        pairs = list(zip(sent.contexts, results, strict=True))
        delivered = [c for c, r in pairs if r is None]
        outages = [(c, r) for c, r in pairs if isinstance(r, PublisherUnavailable)]
        failures = [
            (c, r, self.policy.retry_at(r, c.attempt, batch.clock(), self.rng))
            for c, r in pairs
            if r is not None and not isinstance(r, PublisherUnavailable)
        ]
        # No attempt is counted for an outage: its rows are due again at once
        # (a stream's cursor stays before them), sent again once a probe
        # shows the destination is back.
        sent.settlement.sent(
            delivered,
            [c for c, _ in outages],
            failures,
            lambda outcomes, contexts: self._mark(outcomes, contexts, sent.backlog),
        )
        if not outages:
            if pairs:  # the destination answered
                pauses.resume(self.publisher, batch.clock(), batch.gateway.using)
        else:
            pauses.pause(
                self.publisher,
                outages[0][1],
                batch.clock(),
                batch.gateway.using,
                self.rng,
            )

    def _mark(
        self, outcomes: Outcomes, delivered: list[DeliveryContext], backlog: bool
    ) -> None:
        """Mark ``delivered`` SUCCEEDED; under a backlog, on the sidecar's connection
        while the next batch is sent (the counts join ``outcomes.report`` when
        the mark is done)."""
        if not (backlog and self.marks.enabled) or self.publisher.ordered:
            # No batch to overlap (a second connection would cost more than
            # it saves), or an ordered publisher, whose next heads exist once
            # these are marked.
            outcomes.succeeded(delivered)
            return
        self._merge(done_only=True)
        counts = RelayReport()
        later = Outcomes(outcomes.gateway, outcomes.subscriber, outcomes.token, counts)
        future = self.marks.submit(later.succeeded, delivered)
        self.marking.append((future, counts, outcomes.report))

    def _merge(self, done_only: bool = False) -> None:
        """Add the counts of finished marks to their reports (``done_only``:
        without waiting for the others).

        Raises:
            django.db.DatabaseError: a mark failed (its rows stay RUNNING until
                their lease runs out, then are sent again).
        """
        while self.marking and (not done_only or self.marking[0][0].done()):
            future, counts, report = self.marking.pop(0)
            future.result()
            report += counts

    def close(self) -> None:
        """Collect the batch in flight, wait for the marks, close the second
        connection."""
        try:
            self.finish()
            self._merge()
        finally:
            self.marks.close()


@dataclass
class _Sent:
    batch: Batch | StreamBatch
    settlement: Any
    contexts: list
    handle: Any
    backlog: bool = False  # more batches follow: its mark may overlap them


@dataclass
class _Raised:
    error: BaseException


# --- pauses -------------------------------------------------------------------


@dataclass
class Pause:
    """A publisher paused by an outage of its destination.

    Attributes:
        since: when it paused.
        resume_at: when the next probe may run.
        probes: probes that failed since it paused.
        reason: the transport error that paused it.
        trial: a probe passed and the next batch decides: resumed once it
            reaches the destination, a failed probe if it does not.
    """

    since: datetime.datetime
    resume_at: datetime.datetime
    probes: int
    reason: str
    trial: bool = False


class Pauses:
    """The publishers this process has paused, by subscriber name (shared by
    its threads: an outage is the destination's, whichever thread saw it)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._paused: dict[str, Pause] = {}

    def paused(self, name: str) -> bool:
        """Whether the publisher ``name`` is paused (no probe is run)."""
        return name in self._paused

    def reasons(self) -> dict[str, str]:
        """The paused publishers' names and the errors that paused them."""
        with self._lock:
            return {name: pause.reason for name, pause in self._paused.items()}

    def clear(self) -> None:
        """Forget every pause (tests)."""
        with self._lock:
            self._paused.clear()

    def pause(
        self,
        publisher: Publisher,
        error: BaseException,
        now: datetime.datetime,
        using: str,
        rng: random.Random | None = None,
    ) -> Pause:
        """Pause ``publisher`` (or keep it paused, probing later) after
        ``error``; logs once when it pauses."""
        with self._lock:
            pause = self._paused.get(publisher.name)
            first = pause is None
            reason = mask_url(str(error))
            if first:
                pause = Pause(since=now, resume_at=now, probes=0, reason=reason)
                self._paused[publisher.name] = pause
                relay_metrics.paused(publisher.name, True)
            else:  # a probe failed, or the batch sent on trial
                pause.probes += 1
                pause.reason = reason
                pause.trial = False
            pause.resume_at = now + datetime.timedelta(
                seconds=probe_delay(pause.probes, rng)
            )
        if first:
            logger.error(
                "%s: destination unavailable, publisher paused (no attempts are "
                "counted while it is down; probing again within %.0f s): %s",
                publisher.name,
                outbox_settings.PAUSE_MAX_SECONDS,
                reason,
                extra={"subscriber": publisher.name},
            )
        _save(using, publisher.name, pause, None)
        return pause

    def ready(
        self,
        publisher: Publisher,
        now: datetime.datetime,
        using: str,
        rng: random.Random | None = None,
    ) -> bool:
        """Whether the relay may claim for ``publisher`` now: not paused, or
        paused and a probe, due now, succeeds (which puts it on trial: the
        next batch resumes it, :meth:`resume`, or counts as a failed probe,
        :meth:`pause`)."""
        pause = self._paused.get(publisher.name)
        if pause is None or pause.trial:
            return True
        if now < pause.resume_at:
            return False
        try:
            publisher.probe()
        except Exception as exc:
            self.pause(publisher, exc, now, using, rng)
            return False
        pause.trial = True
        return True

    def resume(
        self,
        publisher: Publisher,
        now: datetime.datetime,
        using: str,
        *,
        sent: bool = True,
    ) -> None:
        """A batch reached ``publisher``'s destination (``sent``), or a
        publisher on trial had nothing to send (``sent=False``: its probe's
        word stands): resume it if it is paused; logs once."""
        pause = self._paused.get(publisher.name)
        if pause is None or not (sent or pause.trial):
            return
        with self._lock:
            if self._paused.pop(publisher.name, None) is None:
                return  # another thread resumed it
        relay_metrics.paused(publisher.name, False)
        logger.warning(
            "%s: destination reachable again, publisher resumed after %.0f s "
            "(%d failed probe(s))",
            publisher.name,
            (now - pause.since).total_seconds(),
            pause.probes,
            extra={"subscriber": publisher.name},
        )
        _save(using, publisher.name, pause, now)


#: This process's paused publishers.
pauses = Pauses()


def probe_delay(probes: int, rng: random.Random | None = None) -> float:
    """Seconds before the next probe after ``probes`` failed ones: doubling
    from 0.5 s to ``OUTBOX_PAUSE_MAX_SECONDS``, "equal jitter" (half of it
    random) so relays that paused together do not probe together."""
    backoff = Backoff(0.5, outbox_settings.PAUSE_MAX_SECONDS, jitter="equal")
    return backoff.delay(probes + 1, rng)


def _save(
    using: str, name: str, pause: Pause, resumed_at: datetime.datetime | None
) -> None:
    """Show the pause to operators (``outbox_status``, the admin overview);
    best effort: a database that is down too must not stop the relay."""
    from ..store.models import SubscriberPause

    try:
        SubscriberPause.objects.using(using).record(name, pause, resumed_at)
    except DatabaseError:
        logger.warning("%s: could not record the pause", name, exc_info=True)
