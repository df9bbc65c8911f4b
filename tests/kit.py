"""Helpers the tests share, one copy each: what an operator sees of
deliveries, whichever engine delivered them; processes (``manage.py``, a
free port, a relay's deliveries awaited, a metrics scrape); fixtures
(publishers closed after a test); and the fuzz tests' counts, printed in the
run's summary.

A pytest plugin too (``pytest_plugins`` in tests/conftest.py): its fixtures
and its hook are everyone's.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterable, Iterator, MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # the models load once Django is set up (bench/soak.py
    # imports this module's free_port before)
    from outbox_app import OutboxEvent

ROOT = Path(__file__).resolve().parents[1]


def deliveries(
    events: Iterable[OutboxEvent] | None = None, using: str = "default"
) -> dict[tuple, str]:
    """``{(event id, subscriber): state}`` of every delivery of ``events``
    (default: every event) as an operator sees it: its row's state, or, by
    stream, SUCCEEDED once the subscriber's cursor passed it and PENDING
    before."""
    from outbox_app import OutboxEvent
    from outbox_app.ops.streams import event_deliveries

    chosen = (
        OutboxEvent.objects.using(using).exclude(event_type=None)
        if events is None
        else events
    )
    return {
        (event.id, subscriber): state
        for event in chosen
        for subscriber, state in event_deliveries(event, using).items()
    }


def states(
    subscriber: str | None = None,
    events: Iterable[OutboxEvent] | None = None,
    using: str = "default",
) -> Counter:
    """How many deliveries (of ``subscriber``, of ``events``) are in each
    state."""
    return Counter(
        state
        for (_, name), state in deliveries(events, using).items()
        if subscriber is None or name == subscriber
    )


def outcome_writes(captured_queries) -> int:
    """How many statements of ``captured_queries`` (Django's
    ``CaptureQueriesContext``) wrote deliveries' outcomes: a row engine's
    SUCCEEDED marks, or a stream cursor's moves."""
    return sum(
        q["sql"].startswith("UPDATE")
        and (
            "SUCCEEDED" in q["sql"]
            # A cursor's move, not its lease taken or handed back.
            or ("SET tick" in q["sql"] and "lease_token = NULL" not in q["sql"])
        )
        for q in captured_queries
    )


def taken() -> bool:
    """Whether a relay has taken deliveries it has not recorded yet: a
    RUNNING row, or a cursor under a lease."""
    from outbox_app import Delivery
    from outbox_app.store.lifecycle import State
    from outbox_app.store.models import Cursor

    return (
        Delivery.objects.filter(state=State.RUNNING).exists()
        or Cursor.objects.exclude(lease_token=None).exists()
    )


def succeeded(using: str = "default") -> int:
    """How many deliveries are done, whichever engine delivered them (see
    :func:`succeeded_ids`)."""
    return sum(succeeded_ids(using).values())


def succeeded_ids(using: str = "default") -> Counter:
    """The events delivered, counted once per subscriber that is done with
    them (SUCCEEDED rows, and events a cursor delivered by stream)."""
    from outbox_app.ops.streams import delivered

    return Counter(i for ids in delivered(using).values() for i in ids)


# --- processes ----------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nothing listens on now (the system's choice)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(
    *args: str,
    cwd: Path = ROOT,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """``manage.py ARGS`` in a process of its own, in ``cwd`` (default: the
    sample project), its output captured as text.

    Args:
        env: its environment; default this process's without the
            ``OUTBOX_``, ``CELERY_``, ``DATABASE_`` and ``DJANGO_`` variables
            (the project's own settings decide).
        check: raise CalledProcessError when it exits non-zero.
    """
    if env is None:
        env = {
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("OUTBOX_", "CELERY_", "DATABASE_", "DJANGO_"))
        }
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=cwd,
        env=env,
        check=check,
        capture_output=True,
        text=True,
        timeout=120,
    )


def scrape(port: int) -> dict[tuple, float]:
    """The Prometheus samples a process serves on ``port`` (``--metrics-port``):
    ``{(name, sorted labels): value}``; empty while it does not answer."""
    from prometheus_client.parser import text_string_to_metric_families

    try:
        url = f"http://127.0.0.1:{port}/metrics"
        with urllib.request.urlopen(url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return {}
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def delivered(relay, count: int) -> None:
    """Wait until ``count`` deliveries are done (:func:`succeeded`), then
    stop ``relay`` (a :class:`tests.processes.Watched` relay process;
    SIGTERM): it must exit cleanly."""
    from tests.processes import wait_for

    try:
        wait_for(
            lambda: succeeded() == count or relay.process.poll() is not None,
            60,
            f"the relay to deliver {count} events",
        )
    finally:
        code = relay.stop()
    assert code == 0, relay.text()[-3000:]


# --- fixtures and optional packages -------------------------------------------------


@pytest.fixture
def _close_publishers() -> Iterator[None]:
    """Close the publishers the test built (their broker connections)."""
    from outbox_app.relay.registry import close_publishers

    yield
    close_publishers()


def needs(package: str, extra: str) -> pytest.MarkDecorator:
    """Skip where the optional ``package`` is not installed (``pip install
    'outbox_app[extra]'``)."""
    return pytest.mark.skipif(
        importlib.util.find_spec(package) is None,
        reason=f"{package} is not installed (pip install 'outbox_app[{extra}]')",
    )


# --- the fuzz tests' counts ---------------------------------------------------------

#: label -> what a fuzz test tried (counts it adds to as it runs).
_TRIED: dict[str, MutableMapping[str, int]] = {}


def tried(label: str, counts: MutableMapping[str, int]) -> MutableMapping[str, int]:
    """Register ``counts`` (a fuzz test's, under ``label``) to be printed in
    the run's summary; returns it."""
    _TRIED[label] = counts
    return counts


def pytest_terminal_summary(terminalreporter) -> None:
    """How many inputs each fuzz test that ran tried."""
    ran = {label: counts for label, counts in _TRIED.items() if any(counts.values())}
    if ran:
        terminalreporter.write_sep("-", "fuzzed inputs")
    for label, counts in ran.items():
        terminalreporter.write_line(f"{label}: {dict(sorted(counts.items()))}")
