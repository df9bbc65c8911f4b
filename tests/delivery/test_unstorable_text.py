"""Text no database column can hold (a lone surrogate, which no UTF-8
encoder takes; a NUL character, which PostgreSQL's text refuses) in what the
relay stores: recorded with backslash escapes, on every database."""

from __future__ import annotations

import decimal

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import Delivery, publish
from outbox_app.models import SubscriberPause
from outbox_app.relay.sending import Pause
from outbox_app.store.lifecycle import State
from tests.processes import Watched, spawn, wait_for
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = pytest.mark.django_db(transaction=True)


def test_a_handler_raising_unstorable_text_fails_its_row_and_the_relay_goes_on():
    """Orders 0 and 5 fail with a lone surrogate and a NUL in their error
    (and traceback): their rows are FAILED with readable text, the relay
    process keeps running and delivers the others."""
    with transaction.atomic():
        publish(*[OrderPlaced(order_id=n, total=decimal.Decimal(n)) for n in range(10)])
    relay = Watched(
        spawn(
            "manage.py",
            "relay",
            "--settings=tests.settings",
            OUTBOX_TEST_HANDLER_SETS="garbled",
            OUTBOX_TEST_RETRY_BASE="600",
            OUTBOX_TEST_RETRY_MAX="600",
        )
    )
    try:
        failed = Delivery.objects.filter(subscriber="garbled", state=State.FAILED)
        wait_for(
            lambda: failed.count() == 2 or relay.process.poll() is not None,
            60,
            "the two failures recorded",
        )
        wait_for(
            lambda: (
                SideEffect.objects.filter(handler="garbled").count() == 8
                or relay.process.poll() is not None
            ),
            60,
            "the other events delivered",
        )
        assert relay.process.poll() is None, relay.text()
    finally:
        code = relay.stop()
    assert code == 0, relay.text()
    assert sorted(failed.values_list("last_error", flat=True)) == [
        "order 0 is \\udcff\\x00 garbled",
        "order 5 is \\udcff\\x00 garbled",
    ]
    assert all(
        "ValueError: order" in row.last_traceback
        and "\\udcff\\x00" in row.last_traceback
        for row in failed
    )
    assert not Delivery.objects.filter(state=State.RUNNING).exists()


def test_a_pause_reason_no_column_can_hold_is_recorded_readably():
    now = timezone.now()
    pause = Pause(since=now, resume_at=now, probes=0, reason="refused \udcff\x00 it")
    SubscriberPause.objects.record("bus", pause, None)
    assert SubscriberPause.objects.get().reason == "refused \\udcff\\x00 it"
