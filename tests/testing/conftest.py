"""The fixtures of outbox_app.testing's pytest plugin (a project enables them
with ``pytest_plugins`` in its root conftest.py; tests/docs and tests/sample
check that way), and handlers registered for one test."""

from __future__ import annotations

import pytest

from outbox_app import handler
from outbox_app.relay.registry import unregister
from outbox_app.testing.pytest import outbox, outbox_publishers  # noqa: F401
from tests.conftest import record_subscribers


@pytest.fixture
def subscribe(request):
    """``subscribe(*types, **options)(fn)``: ``@handler`` for this test only
    (recorded, as a deploy does); the name defaults to
    ``testing.<fn name>``."""
    names: list[str] = []

    def add(*types, **options):
        def register(fn):
            options.setdefault("name", f"testing.{fn.__name__}")
            names.append(options["name"])
            registered = handler(*types, **options)(fn)
            record_subscribers(request, [options["name"]])
            return registered

        return register

    yield add
    for name in names:
        unregister(name)
