"""Retry delays: capped exponential backoff with full jitter.

``delay = uniform(0, min(cap, base * 2 ** (attempt - 1)))``, the "full jitter"
strategy of AWS's *Exponential Backoff and Jitter* (2015): retries of many
failing rows spread out instead of arriving together.
"""

from __future__ import annotations

import random


def backoff_ceiling(attempt: int, base: float, cap: float) -> float:
    """Largest delay after failed attempt number ``attempt`` (1-based), in seconds."""
    if attempt < 1:
        return 0.0
    # 2 ** 63 would overflow float math for absurd attempt counts; the cap wins
    # long before that.
    return min(cap, base * 2 ** min(attempt - 1, 62))


def retry_delay(
    attempt: int, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """Seconds to wait before retrying after failed attempt ``attempt``.

    Args:
        attempt: the attempt that just failed, 1 for the first.
        base: ceiling of the first delay, in seconds.
        cap: largest ceiling, in seconds.
        rng: source of randomness (tests pass a seeded one).

    Returns:
        A float in ``[0, backoff_ceiling(attempt, base, cap)]``.
    """
    return (rng or random).uniform(0.0, backoff_ceiling(attempt, base, cap))
