"""pytest fixtures of :mod:`outbox_app.testing`, for pytest-django suites.

Enable them in the ``conftest.py`` at your project's root::

    pytest_plugins = ["outbox_app.testing.pytest"]

(or ``-p outbox_app.testing.pytest`` in ``addopts``). A test that publishes
needs the database as any test that writes does (``@pytest.mark.django_db``,
or the ``db`` or ``transactional_db`` fixture).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from . import CapturedEvents, SentMessages


@pytest.fixture
def outbox() -> Iterator[CapturedEvents]:
    """What the test publishes, from this fixture's set-up on:
    :func:`~outbox_app.testing.capture_events` around the test
    (``outbox.assert_published(...)``, ``outbox.deliver_now()``)."""
    from . import capture_events

    with capture_events() as captured:
        yield captured


@pytest.fixture
def outbox_publishers() -> Iterator[SentMessages]:
    """Every ``OUTBOX_PUBLISHERS`` entry but Celery's records instead of
    sending, for the test: :func:`~outbox_app.testing.record_publishers`;
    the value is what they sent (``outbox_publishers.to("rabbitmq")``)."""
    from . import record_publishers

    with record_publishers() as sent:
        yield sent
