"""``manage.py outbox_requeue``."""

from __future__ import annotations

import datetime
import io

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.utils import timezone

from outbox_app import Delivery
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

pytestmark = pytest.mark.django_db


@pytest.fixture
def rows():
    first, second, third, fourth = events(4)
    long_ago = timezone.now() - datetime.timedelta(days=10)
    return {
        "expired": delivery(first, "ops.record", State.DEAD),
        "failed": delivery(second, "ops.record", State.FAILED),
        "value_error": delivery(
            third, "ops.record", State.DEAD, last_error_type="builtins.ValueError"
        ),
        "old": delivery(fourth, "ops.record", State.DEAD, updated_at=long_ago),
        "other": delivery(first, "other", State.DEAD),
    }


def requeue(*args: str) -> str:
    out = io.StringIO()
    with subscribed("OrderPlaced"), subscribed("OrderPlaced", name="other"):
        call_command("outbox_requeue", *args, stdout=out)
    return out.getvalue()


def states(rows) -> dict[str, str]:
    return {key: Delivery.objects.get(pk=row.pk).state for key, row in rows.items()}


def test_requeue__every_failed_and_expired_row_of_the_subscriber(rows):
    out = requeue("--subscriber", "ops.record")
    assert "Requeued 4 FAILED/DEAD deliveries of ops.record." in out
    assert states(rows) == {
        "expired": State.PENDING,
        "failed": State.PENDING,
        "value_error": State.PENDING,
        "old": State.PENDING,
        "other": State.DEAD,
    }
    requeued = Delivery.objects.get(pk=rows["expired"].pk)
    assert requeued.attempts == 0
    assert requeued.last_error == "broker down"


def test_requeue__filters_combine(rows):
    yesterday = (timezone.now() - datetime.timedelta(days=1)).date().isoformat()
    out = requeue(
        "--subscriber",
        "ops.record",
        "--state",
        "DEAD",
        "--error-type",
        "builtins.ConnectionError",
        "--since",
        yesterday,
    )
    assert "Requeued 1 DEAD delivery of ops.record." in out
    assert states(rows)["expired"] == State.PENDING
    assert sum(s == State.PENDING for s in states(rows).values()) == 1


def test_requeue__since_accepts_a_date_time_with_offset(rows):
    moment = (timezone.now() - datetime.timedelta(days=20)).isoformat()
    out = requeue("--subscriber", "ops.record", "--since", moment, "--dry-run")
    assert "Would requeue 4" in out


def test_requeue__dry_run_changes_nothing(rows):
    out = requeue("--subscriber", "ops.record", "--state", "FAILED", "--dry-run")
    assert "Would requeue 1 FAILED delivery of ops.record (dry run" in out
    assert states(rows)["failed"] == State.FAILED


def test_requeue__unknown_subscriber_is_a_command_error(rows):
    with pytest.raises(CommandError, match="no handler or publisher is named"):
        requeue("--subscriber", "nobody")


def test_requeue__bad_arguments(rows):
    with pytest.raises(CommandError, match="--since"):
        requeue("--subscriber", "ops.record", "--since", "yesterday")
    with pytest.raises(CommandError, match="--state"):
        requeue("--subscriber", "ops.record", "--state", "PENDING")
    with pytest.raises(CommandError, match="--subscriber"):
        call_command("outbox_requeue")
