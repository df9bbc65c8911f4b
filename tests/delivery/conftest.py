"""Fixtures of the delivery tests."""

from __future__ import annotations

import pytest

from outbox_app import handler
from outbox_app.relay.registry import unregister


@pytest.fixture
def registered():
    names = []

    def add(*types, name, **options):
        def register(fn):
            handler(*types, name=name, **options)(fn)
            names.append(name)
            return fn

        return register

    yield add
    for name in names:
        unregister(name)
