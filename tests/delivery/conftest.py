"""Fixtures of the delivery tests."""

from __future__ import annotations

import pytest

from outbox_app import handler
from outbox_app.relay.registry import unregister
from tests.conftest import record_subscribers


@pytest.fixture
def registered(request):
    """``@registered(*types, name=..., **options)``: register a handler for
    the test (and record it, as a deploy does); removed afterwards."""
    names = []

    def add(*types, name, **options):
        def register(fn):
            handler(*types, name=name, **options)(fn)
            names.append(name)
            record_subscribers(request, [name])
            return fn

        return register

    yield add
    for name in names:
        unregister(name)
