"""A real Celery worker with beat, on RabbitMQ, runs the relay tasks."""

from __future__ import annotations

import datetime
import decimal

import pytest
from django.db import transaction
from django.utils import timezone

from outbox_app import publish
from outbox_app.tasks import beat_schedule
from tests.conftest import require_service
from tests.processes import celery_worker, wait_for
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


@pytest.fixture
def celery_app():
    require_service("rabbitmq")
    from tests.celery_app import app

    yield app
    with app.connection_for_write() as conn:
        conn.default_channel.queue_delete(app.conf.task_default_queue)


def start_worker(app, tmp_path, beat_interval: float):
    return celery_worker(
        "--beat",
        "--schedule",
        str(tmp_path / "beat-schedule"),
        OUTBOX_TEST_HANDLER_SETS="record",
        OUTBOX_TEST_BEAT_INTERVAL=str(beat_interval),
        OUTBOX_TEST_CELERY_QUEUE=app.conf.task_default_queue,
    )


def test_beat_schedule_fragment():
    schedule = beat_schedule(interval=2.0)
    assert {e["task"] for e in schedule.values()} == {
        "outbox_app.relay_events",
        "outbox_app.run_handlers",
        "outbox_app.purge_outbox",
    }
    relay = schedule["outbox-relay-events"]
    assert relay["schedule"] == 2.0 and relay["options"] == {"expires": 2.0}
    assert relay["kwargs"]["max_seconds"] == 1.8


def test_beat_runs_every_10_s_when_commits_wake_the_relay(settings):
    """With the wake-up on, beat is the safety net: an idle worker runs (and
    logs) a relay task every 10 s, not every second; without it, beat is the
    latency and stays at 1 s."""
    settings.OUTBOX_CELERY_WAKE = True
    assert beat_schedule()["outbox-run-handlers"]["schedule"] == 10.0
    settings.OUTBOX_CELERY_WAKE = False
    assert beat_schedule()["outbox-run-handlers"]["schedule"] == 1.0


def test_a_run_out_of_time_with_work_left_enqueues_the_next(handlers, monkeypatch):
    from outbox_app.tasks import run_handlers

    handlers("slow")  # 0.2 s per delivery
    with transaction.atomic():
        publish(*[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(5)])
    sent = []
    monkeypatch.setattr(
        run_handlers, "apply_async", lambda **options: sent.append(options)
    )
    result = run_handlers(max_seconds=0.3)
    assert result["continued"] is True
    assert sent == [
        {
            "kwargs": {"using": "default", "max_seconds": 0.3, "batch_size": None},
            "expires": 30.0,
        }
    ]
    sent.clear()
    while "continued" in run_handlers(max_seconds=5):  # drain
        pass
    assert "continued" not in run_handlers(max_seconds=0.3)  # nothing left
    assert SideEffect.objects.filter(handler="slow").count() == 5


@pytest.mark.services("rabbitmq")
def test_worker_and_beat_deliver_committed_events(celery_app, tmp_path):
    worker = start_worker(celery_app, tmp_path, beat_interval=0.5)
    try:
        with transaction.atomic():
            publish(
                *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(5)]
            )
        with pytest.raises(RuntimeError), transaction.atomic():
            publish(OrderPlaced(order_id=99, total=decimal.Decimal(1)))
            raise RuntimeError("rolled back")
        wait_for(lambda: SideEffect.objects.count() == 10, 60, "beat-driven delivery")
    finally:
        worker.stop()
    assert SideEffect.objects.filter(handler="record_a").count() == 5


@pytest.mark.services("rabbitmq")
def test_on_commit_wakeup_enqueues_the_relay(celery_app, tmp_path, settings, handlers):
    """Beat runs every hour here: only the on-commit wake-up can deliver."""
    interval = 3600
    settings.OUTBOX_CELERY_WAKE = True
    settings.OUTBOX_CELERY_APP = "tests.celery_app.app"
    handlers("record")  # so wake() knows handlers exist
    worker = start_worker(celery_app, tmp_path, beat_interval=interval)
    started = timezone.now()
    try:
        with transaction.atomic():
            [event] = publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
        wait_for(lambda: SideEffect.objects.count() == 2, 60, "wake-up delivery")
    finally:
        worker.stop()
    first_beat = started + datetime.timedelta(seconds=interval)
    for effect in SideEffect.objects.all():
        assert event.created_at < effect.seen_at < first_beat
    assert worker.has("outbox_app.run_handlers")
