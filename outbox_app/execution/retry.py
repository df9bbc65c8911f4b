"""The retry policy: what a failed attempt means for its delivery.

A decision is a value: ``retry_at`` for a FAILED row that will be tried again,
``None`` for the dead letter (DEAD).
Everything that decides between the two lives here, once, for handlers,
publishers and consumers alike (:meth:`RetryPolicy.of`, from the options of
:class:`~outbox_app.subscribers.Receiver`):

* ``give_up_on`` exceptions, and exceptions outside ``retry_on``, are dead at
  once (a publisher gives up on :class:`~outbox_app.exceptions.UndeliverableMessage`);
* the attempt that reaches ``max_attempts`` goes to the dead letter;
* otherwise the row is due again after a capped exponential backoff with full
  jitter (:class:`Backoff`: ``uniform(0, min(cap, base * 2 ** (attempt -
  1)))``), counted from the failure;
* the lease rule: a row claimed with more attempts than allowed had its last
  allowed attempt's lease run out (its worker died or hung past the lease). It
  is not run again: it is dead with :class:`~outbox_app.exceptions.LeaseLost`.

A transport outage (:class:`~outbox_app.exceptions.PublisherUnavailable`) is
not an attempt at all: the publisher runner hands such rows back before they
reach this policy.
"""

from __future__ import annotations

import datetime
import random
from dataclasses import dataclass

from ..conf import outbox_settings
from ..exceptions import LeaseLost
from ..subscribers import Receiver


@dataclass(frozen=True)
class RetryPolicy:
    """How one subscriber's failed attempts are retried.

    Attributes:
        max_attempts: attempts before the dead letter.
        retry_on: exception classes retried with backoff.
        give_up_on: exception classes dead-lettered at once (checked first).
        base, cap: backoff's first and largest ceiling, in seconds.
    """

    max_attempts: int
    retry_on: tuple[type[BaseException], ...] = (Exception,)
    give_up_on: tuple[type[BaseException], ...] = ()
    base: float = 1.0
    cap: float = 600.0

    @classmethod
    def of(cls, receiver: Receiver) -> RetryPolicy:
        """The policy of ``receiver`` (a handler, a publisher, a consumer:
        its ``max_attempts``, ``retry_on`` and ``give_up_on``) with the
        current ``OUTBOX_*`` settings."""
        return cls(
            max_attempts=receiver.attempts_allowed,
            retry_on=receiver.retry_on,
            give_up_on=receiver.give_up_on,
            base=outbox_settings.RETRY_BASE_SECONDS,
            cap=outbox_settings.RETRY_MAX_SECONDS,
        )

    def lease_ran_out(self, attempt: int) -> LeaseLost | None:
        """The error to dead-letter a row claimed for ``attempt`` with, if its last
        allowed attempt never finished; ``None`` if it may run."""
        if attempt <= self.max_attempts:
            return None
        return LeaseLost(
            f"attempt {attempt - 1} of {self.max_attempts} never finished: its "
            "worker died or hung past the lease"
        )

    def retry_at(
        self,
        error: BaseException,
        attempt: int,
        now: datetime.datetime,
        rng: random.Random | None = None,
    ) -> datetime.datetime | None:
        """When to try again after ``error`` ended ``attempt`` (1-based) at
        ``now``; ``None`` sends the row to the dead letter."""
        if isinstance(error, (LeaseLost, *self.give_up_on)) or not isinstance(
            error, self.retry_on
        ):
            return None
        if attempt >= self.max_attempts:
            return None
        delay = Backoff(self.base, self.cap).delay(attempt, rng)
        return now + datetime.timedelta(seconds=delay)


@dataclass(frozen=True)
class Backoff:
    """Waits that double from ``base`` up to ``cap`` seconds: the one backoff of
    outbox_app, for failed deliveries, paused publishers' probes and the relay's
    and ``consume``'s reconnects.

    Attributes:
        base: the first wait's ceiling, in seconds.
        cap: the largest ceiling, in seconds.
        jitter: ``"full"``: uniform in ``[0, ceiling]`` (AWS's "full jitter":
            many rows failing together spread out); ``"equal"``: half the
            ceiling plus a uniform half (processes that paused together never
            probe together, nor sooner than half the ceiling); ``"none"``: the
            ceiling (one process's own reconnects).
    """

    base: float
    cap: float
    jitter: str = "full"

    def ceiling(self, attempt: int) -> float:
        """The largest wait after failure number ``attempt`` (1-based), in
        seconds: ``min(cap, base * 2 ** (attempt - 1))``; 0 before any."""
        if attempt < 1:
            return 0.0
        # 2 ** 63 would overflow float math for absurd attempt counts; the cap
        # wins long before that.
        return min(self.cap, self.base * 2 ** min(attempt - 1, 62))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after failure number ``attempt`` (1-based).

        Args:
            attempt: the failure just counted, 1 for the first.
            rng: source of randomness (tests pass a seeded one).

        Returns:
            A float in ``[0, ceiling(attempt)]`` (``"equal"``: in its upper half).
        """
        ceiling = self.ceiling(attempt)
        if self.jitter == "none":
            return ceiling
        if self.jitter == "equal":
            return ceiling / 2 + (rng or random).uniform(0.0, ceiling / 2)
        return (rng or random).uniform(0.0, ceiling)


#: The relay's and ``consume``'s reconnects to an unreachable database or
#: broker: 0.5 s doubling to 30 s.
RECONNECT = Backoff(base=0.5, cap=30.0, jitter="none")
