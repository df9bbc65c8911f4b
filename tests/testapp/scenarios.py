"""Handlers the delivery tests register, in-process or in relay worker processes.

Not a ``handlers`` module on purpose: autodiscovery would register them in every
test. ``register(name)`` registers one set by name; worker processes started by
the tests call it too.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from outbox_app import handler
from outbox_app.relay.registry import unregister

from .events import OrderPlaced, Step
from .models import SideEffect


def _record(name: str, event, context) -> None:
    SideEffect.objects.create(
        handler=name,
        event_id=context.event_id,
        position=getattr(event, "position", None),
        aggregate=context.aggregate_id or "",
    )


def record_a(event, context):
    _record("record_a", event, context)


def record_b(event, context):
    _record("record_b", event, context)


def audit(event, context):
    _record("audit", event, context)


def flaky(name: str, rate: float):
    def run(event, context):
        _record(name, event, context)  # written, then rolled back on failure
        if random.random() < rate:
            raise ConnectionError(f"flaky {name} failed on attempt {context.attempt}")

    return run


def record_ordered(event, context):
    _record("ordered", event, context)


def hang(event, context):
    """Writes, says it started (a marker file), then hangs until killed."""
    _record("hang", event, context)
    Path(os.environ["OUTBOX_TEST_MARKER"]).write_text(str(context.event_id))
    time.sleep(600)


def slow(event, context):
    """Writes, says it started, and takes a while: for shutdown tests."""
    _record("slow", event, context)
    marker = os.environ.get("OUTBOX_TEST_MARKER")
    if marker:
        Path(marker).write_text(str(context.event_id))
    time.sleep(0.2)


def logged(name: str):
    """Appends ``name event_id`` to ``$OUTBOX_TEST_LOG`` (outside the
    database: every run shows, a rolled-back one too), then takes a while, so
    a relay that takes a lease over while it runs is seen running it twice."""

    def run(event, context):
        with open(os.environ["OUTBOX_TEST_LOG"], "a") as log:
            log.write(f"{name} {context.event_id}\n")
        time.sleep(0.3)

    return run


def broken(event, context):
    """Always fails: for failure counters and the dead letter."""
    raise ValueError(f"broken handler refuses event {context.event_id}")


def garbled(event, context):
    """Fails for every fifth order with text no column can hold (a lone
    surrogate, a NUL character); records the others."""
    if event.order_id % 5 == 0:
        raise ValueError(f"order {event.order_id} is \udcff\x00 garbled")
    _record("garbled", event, context)


SETS = {
    "record": [
        ("record_a", OrderPlaced, record_a, {}),
        ("record_b", OrderPlaced, record_b, {}),
    ],
    "flaky": [
        ("flaky_a", OrderPlaced, flaky("flaky_a", 0.1), {}),
        ("flaky_b", OrderPlaced, flaky("flaky_b", 0.1), {}),
    ],
    "ordered": [("ordered", Step, flaky("ordered", 0.1), {"ordered": True})],
    "audit": [("audit", OrderPlaced, audit, {})],
    "hang": [("hang", OrderPlaced, hang, {})],
    "slow": [("slow", OrderPlaced, slow, {})],
    "broken": [("broken", OrderPlaced, broken, {})],
    "garbled": [("garbled", OrderPlaced, garbled, {})],
    "clock_a": [("clock_a", OrderPlaced, logged("clock_a"), {})],
    "clock_b": [("clock_b", OrderPlaced, logged("clock_b"), {})],
}


def register(set_name: str) -> list[str]:
    """Register the handlers of ``SETS[set_name]``. Their stream delivery
    starts at the earliest event kept: a relay process the tests start
    records them only when it runs, after the test published."""
    names = []
    for name, event, fn, options in SETS[set_name]:
        handler(event, name=name, **{"start": "earliest", **options})(fn)
        names.append(name)
    return names


def unregister_all() -> None:
    for entries in SETS.values():
        for name, *_ in entries:
            unregister(name)
