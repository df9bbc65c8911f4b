"""The retry policy (execution/retry.py): what a failed attempt means, with no
database: a time to try again, or the dead letter."""

from __future__ import annotations

import datetime
import random

import pytest

from outbox_app.exceptions import LeaseLost, UndeliverableMessage
from outbox_app.execution.retry import RECONNECT, Backoff, RetryPolicy
from outbox_app.publishers.base import Publisher
from outbox_app.subscribers import Handler

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


@pytest.mark.parametrize(
    ("attempt", "ceiling"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (10, 512.0), (11, 600.0), (10**6, 600.0)],
)
def test_the_ceiling_doubles_from_base_up_to_the_cap(attempt, ceiling):
    assert Backoff(base=1.0, cap=600.0).ceiling(attempt) == ceiling


def test_the_delay_is_full_jitter_below_the_ceiling():
    rng = random.Random(7)
    delays = [Backoff(1.0, 600.0).delay(4, rng) for _ in range(2000)]
    assert all(0.0 <= d <= 8.0 for d in delays)
    # Spread over the whole range, not bunched at the ceiling.
    assert min(delays) < 0.5 and max(delays) > 7.5


def test_equal_jitter_stays_in_the_upper_half_and_reconnects_have_none():
    rng = random.Random(3)
    probes = [Backoff(0.5, 60.0, jitter="equal").delay(3, rng) for _ in range(500)]
    assert all(1.0 <= d <= 2.0 for d in probes) and max(probes) - min(probes) > 0.9
    assert [RECONNECT.delay(n) for n in (1, 2, 3, 7, 8)] == [0.5, 1.0, 2.0, 30.0, 30.0]


def test_a_retried_error_is_due_again_within_its_ceiling():
    policy = RetryPolicy(max_attempts=5, base=2.0, cap=30.0)
    for attempt in range(1, 5):
        at = policy.retry_at(ValueError("x"), attempt, NOW, random.Random(attempt))
        assert NOW <= at <= NOW + datetime.timedelta(seconds=2.0 * 2 ** (attempt - 1))


def test_the_last_attempt_goes_to_the_dead_letter():
    policy = RetryPolicy(max_attempts=3)
    assert policy.retry_at(ValueError("x"), 2, NOW) is not None
    assert policy.retry_at(ValueError("x"), 3, NOW) is None


def test_give_up_on_wins_and_errors_outside_retry_on_are_dead_at_once():
    policy = RetryPolicy(
        max_attempts=10, retry_on=(OSError,), give_up_on=(TimeoutError,)
    )
    assert policy.retry_at(ConnectionError("x"), 1, NOW) is not None  # an OSError
    assert policy.retry_at(TimeoutError("x"), 1, NOW) is None  # an OSError, given up
    assert policy.retry_at(KeyError("x"), 1, NOW) is None  # outside retry_on


def test_a_lease_that_ran_out_on_the_last_attempt_is_never_run_again():
    policy = RetryPolicy(max_attempts=3)
    assert policy.lease_ran_out(3) is None
    error = policy.lease_ran_out(4)
    assert isinstance(error, LeaseLost) and "attempt 3 of 3" in str(error)
    assert policy.retry_at(error, 1, NOW) is None


def test_a_publisher_gives_up_only_on_what_can_never_be_sent(settings):
    settings.OUTBOX_MAX_ATTEMPTS = 4
    settings.OUTBOX_RETRY_BASE_SECONDS = 0.5
    settings.OUTBOX_RETRY_MAX_SECONDS = 9.0

    class Nowhere(Publisher):
        def send(self, contexts):
            return [None for _ in contexts]

    policy = RetryPolicy.of(Nowhere("nowhere", {}))
    assert (policy.max_attempts, policy.base, policy.cap) == (4, 0.5, 9.0)
    assert policy.retry_at(UndeliverableMessage("too big"), 1, NOW) is None
    assert policy.retry_at(RuntimeError("nack"), 1, NOW) is not None


def test_a_handler_brings_its_own_attempts_and_errors():
    spec = Handler(
        name="h",
        event_types=None,
        max_attempts=2,
        retry_on=(ValueError,),
        give_up_on=(),
    )
    policy = RetryPolicy.of(spec)
    assert policy.max_attempts == 2
    assert policy.retry_at(TypeError("x"), 1, NOW) is None
