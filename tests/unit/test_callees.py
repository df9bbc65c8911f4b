"""Handlers and consumers are one shape of callee: the options they share
are declared once, documented on the base as Celery documents a Task's
attributes, and make the one retry policy; the relay's and the inbox's
counts are one counting type."""

from __future__ import annotations

import datetime
import inspect
from dataclasses import fields

import pytest

from outbox_app.execution.retry import RetryPolicy
from outbox_app.inbox.outcomes import Tally
from outbox_app.inbox.registry import Consumer
from outbox_app.relay.outcomes import RelayReport
from outbox_app.subscribers import Handler

NOW = datetime.datetime(2025, 6, 1, tzinfo=datetime.UTC)
SHARED = {
    "name",
    "fn",
    "event_types",
    "ordered",
    "max_attempts",
    "retry_on",
    "give_up_on",
    "timeout",
}


def test_handlers_and_consumers_share_one_base_that_declares_their_options():
    from outbox_app.subscribers import Callee

    assert issubclass(Handler, Callee) and issubclass(Consumer, Callee)
    assert {f.name for f in fields(Callee)} == SHARED
    for cls in (Handler, Consumer):
        own = set(vars(cls).get("__annotations__", {}))
        assert not own & SHARED, f"{cls.__name__} declares {own & SHARED} again"


def test_every_option_of_the_base_is_documented_where_it_is_declared():
    """As Celery's Task: a ``#:`` comment above each attribute, which pydoc
    and Sphinx show."""
    from outbox_app import subscribers

    for cls in subscribers.Callee.__mro__:
        if cls is object:
            continue
        lines = inspect.getsource(cls).splitlines()
        for name in vars(cls).get("__annotations__", {}):
            [index] = [
                i for i, line in enumerate(lines) if line.startswith(f"    {name}:")
            ]
            assert lines[index - 1].lstrip().startswith("#:"), f"{cls.__name__}.{name}"


@pytest.mark.parametrize("kind", ["handler", "consumer"])
def test_a_handler_and_a_consumer_reach_their_policy_by_one_path(kind, settings):
    settings.OUTBOX_MAX_ATTEMPTS = 9
    options = {
        "name": "c",
        "event_types": None,
        "max_attempts": 3,
        "retry_on": (ValueError,),
        "give_up_on": (KeyError,),
    }
    callee = Handler(**options) if kind == "handler" else Consumer(**options, queue="q")
    policy = RetryPolicy.of(callee)
    assert policy.max_attempts == 3
    assert policy.retry_at(ValueError("x"), 1, NOW) is not None
    assert policy.retry_at(KeyError("x"), 1, NOW) is None  # give_up_on first
    assert policy.retry_at(TypeError("x"), 1, NOW) is None  # outside retry_on
    assert policy.retry_at(ValueError("x"), 3, NOW) is None  # the last attempt


def test_the_relay_and_the_inbox_count_with_one_type():
    from outbox_app.execution.metrics import Counts

    report, tally = RelayReport(succeeded=2), Tally(handled=1)
    assert isinstance(report, Counts) and isinstance(tally, Counts)
    report += RelayReport(succeeded=1, dead=1)
    assert report.as_dict()["succeeded"] == 3
    assert "succeeded=3 failed=0 dead=1" in report.fields()
    assert tally.fields().startswith("handled=1 duplicates=0")
    assert str(tally).startswith("handled 1, duplicates 0")
