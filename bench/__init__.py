"""Benchmarks: each measures outbox_app against a baseline in the same run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def without_claim_ahead() -> Iterator[None]:
    """The relay as it was before claiming the next batch ahead: one batch at a
    time on one connection (to show what the overlap buys)."""
    from outbox_app.relay import _ClaimAhead

    submit = _ClaimAhead.submit
    _ClaimAhead.submit = lambda self, subscriber, claim: None
    try:
        yield
    finally:
        _ClaimAhead.submit = submit
