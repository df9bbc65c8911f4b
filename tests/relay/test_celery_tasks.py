"""Celery tasks through the outbox: ``enqueue()`` writes the task in the
caller's transaction, the relay's CeleryPublisher sends it with ``send_task``
(task id = event id), and a real worker on RabbitMQ or Redis runs it."""

from __future__ import annotations

import datetime
import json
import signal
import uuid

import pytest
from celery import chain, group, signature
from django.db import transaction
from django.utils import timezone

from outbox_app import OutboxEvent, enqueue
from outbox_app.exceptions import (
    NoTaskPublisher,
    OutboxRequiresActiveTransaction,
    PublisherUnavailable,
    UnsupportedTask,
)
from outbox_app.ops.checks import check_settings
from outbox_app.publishers.base import build_publisher
from outbox_app.publishers.celery import CeleryPublisher
from outbox_app.publishing.enqueue import TASK_BACKEND, TASK_EVENT_TYPE
from outbox_app.store.lifecycle import State
from outbox_app.store.models import Delivery
from tests.conftest import require_service
from tests.kit import free_port
from tests.processes import Watched, celery_worker, spawn, wait_for
from tests.services import RABBITMQ_URL, REDIS_URL

TASKS = {"tasks": {"BACKEND": TASK_BACKEND}}
RECORD = "tests.record_task"


@pytest.fixture
def tasks_publisher(settings):
    settings.OUTBOX_PUBLISHERS = TASKS


@pytest.mark.django_db(transaction=True)
def test_enqueue_writes_the_task_as_one_event(tasks_publisher):
    eta = timezone.now() + datetime.timedelta(hours=1)
    with transaction.atomic():
        event = enqueue(
            signature(RECORD, args=("/tmp/x", 1), kwargs={"v": [2]}).set(
                queue="mail", priority=3, eta=eta, expires=7200
            )
        )
    stored = OutboxEvent.objects.get()
    assert stored.id == event.id and stored.event_type == TASK_EVENT_TYPE
    assert stored.deliver_at == eta
    expires = stored.expires_at - stored.occurred_at
    assert datetime.timedelta(seconds=7199) < expires < datetime.timedelta(seconds=7201)
    assert stored.payload == {
        "task": RECORD,
        "args": ["/tmp/x", 1],
        "kwargs": {"v": [2]},
        "options": {
            "queue": "mail",
            "priority": 3,
            "expires": stored.expires_at.isoformat(),
        },
    }
    # countdown wins over eta, as in Celery.
    with transaction.atomic():
        later = enqueue(signature(RECORD).set(eta=eta, countdown=5))
    due = OutboxEvent.objects.get(id=later.id).deliver_at - timezone.now()
    assert datetime.timedelta(seconds=3) < due <= datetime.timedelta(seconds=5)


@pytest.mark.django_db(transaction=True)
def test_what_enqueue_cannot_send_is_refused_and_nothing_written(
    tasks_publisher, settings
):
    one = signature(RECORD, args=("/tmp/x", 1))
    refused = [
        (chain(one, one), "not a chain"),
        (group(one, one), "not a group"),
        (one.clone().set(task_id="mine"), "drop the task_id option"),
        ({"task": RECORD}, "takes a Celery signature"),
        (one.clone().set(countdown="soon"), "countdown option must be seconds"),
    ]
    with transaction.atomic():
        for value, message in refused:
            with pytest.raises(UnsupportedTask, match=message):
                enqueue(value)
    with pytest.raises(OutboxRequiresActiveTransaction):
        enqueue(one)
    settings.OUTBOX_PUBLISHERS = {}
    with transaction.atomic(), pytest.raises(NoTaskPublisher, match=TASK_BACKEND):
        enqueue(one)
    assert not OutboxEvent.objects.exists()


def test_the_publisher_takes_tasks_only(settings):
    with pytest.raises(Exception, match="'EVENT_TYPES' is fixed"):
        build_publisher("tasks", {"BACKEND": TASK_BACKEND, "EVENT_TYPES": ["*"]})
    with pytest.raises(Exception, match=r"unknown option\(s\) \['APP'\]"):
        build_publisher("tasks", {"BACKEND": TASK_BACKEND, "APP": "x.y"})
    publisher = build_publisher("tasks", {"BACKEND": TASK_BACKEND, "ORDERED": True})
    assert publisher.event_types == {TASK_EVENT_TYPE} and publisher.ordered
    # No app named and no CELERY_BROKER_URL: Celery's default broker.
    settings.OUTBOX_PUBLISHERS = TASKS
    assert [m.id for m in check_settings()] == ["outbox.W004"]
    settings.OUTBOX_CELERY_APP = "tests.celery_app.app"
    assert check_settings() == []


def test_an_unreachable_broker_is_an_outage_not_a_failure(settings):
    port = free_port()
    settings.OUTBOX_CELERY_APP = None
    settings.CELERY_BROKER_URL = f"amqp://guest:secret@127.0.0.1:{port}//"
    settings.CELERY_BROKER_CONNECTION_TIMEOUT = 1
    publisher = CeleryPublisher("tasks", {})

    class Message:
        event_id = uuid.uuid4()
        payload = {"task": RECORD, "args": [], "kwargs": {}, "options": {}}

    outcomes = publisher.send_batch([Message(), Message()])
    assert [type(o) for o in outcomes] == [PublisherUnavailable] * 2
    assert "secret" not in str(outcomes[0]) and str(port) in str(outcomes[0])
    with pytest.raises(Exception):  # noqa: B017 (the broker's own error)
        publisher.probe()
    publisher.close()


# --- a real worker ----------------------------------------------------------------

BROKERS = {"rabbitmq": RABBITMQ_URL, "redis": REDIS_URL}


@pytest.fixture(params=sorted(BROKERS))
def broker(request, tmp_path):
    """A broker, a queue of the test's own and a worker consuming it; yields
    the environment a relay process sends to them with."""
    require_service(request.param)
    queue = f"outbox-tasks-{uuid.uuid4().hex[:8]}"
    env = {
        "OUTBOX_TEST_CELERY_BROKER": BROKERS[request.param],
        "OUTBOX_TEST_CELERY_QUEUE": queue,
        "OUTBOX_TEST_CELERY_APP": "tests.celery_app.app",
        "OUTBOX_TEST_PUBLISHERS": json.dumps(TASKS),
    }
    worker = celery_worker(**env)
    try:
        yield env
    finally:
        worker.stop()
        from tests.celery_app import app

        with app.connection_for_write(BROKERS[request.param]) as conn:
            conn.default_channel.queue_delete(queue)


def relay(env: dict, **more: str) -> Watched:
    return Watched(
        spawn("manage.py", "relay", "--settings=tests.settings", **env, **more)
    )


def ran(path) -> list[tuple[str, str]]:
    """(task id, value) of each run the worker recorded."""
    if not path.exists():
        return []
    return [tuple(line.split(" ", 1)) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_committed_task_runs_once_a_rolled_back_one_never(broker, tmp_path, settings):
    settings.OUTBOX_PUBLISHERS = TASKS
    out = tmp_path / "ran"
    with transaction.atomic():
        committed = [enqueue(signature(RECORD, args=(str(out), i))) for i in range(3)]
    try:
        with transaction.atomic():
            enqueue(signature(RECORD, args=(str(out), "rolled back")))
            raise RuntimeError("roll back")
    except RuntimeError:
        pass
    process = relay(broker)
    try:
        wait_for(lambda: len(ran(out)) >= 3, 60, "the worker to run 3 tasks")
        wait_for(
            lambda: Delivery.objects.filter(state=State.SUCCEEDED).count() == 3,
            30,
            "the deliveries marked",
        )
    finally:
        process.stop()
    assert sorted(ran(out)) == sorted(
        (str(e.id), str(i)) for i, e in enumerate(committed)
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_relay_killed_between_send_and_record_sends_it_again_with_its_id(
    broker, tmp_path, settings
):
    settings.OUTBOX_PUBLISHERS = TASKS
    out = tmp_path / "ran"
    with transaction.atomic():
        event = enqueue(signature(RECORD, args=(str(out), "once")))
    killing = {"tasks": {"BACKEND": "tests.testapp.publishers.KillingCeleryPublisher"}}
    first = relay(
        {**broker, "OUTBOX_TEST_PUBLISHERS": json.dumps(killing)},
        OUTBOX_TEST_KILL_AT="send:1:after",
        OUTBOX_TEST_LEASE="2",
    )
    wait_for(lambda: first.process.poll() is not None, 60, "the relay to die")
    assert first.process.returncode == -signal.SIGKILL
    first.stop()
    wait_for(lambda: len(ran(out)) >= 1, 60, "the worker to run the first send")
    row = Delivery.objects.get()
    assert row.state == State.RUNNING  # sent, never recorded
    second = relay(broker, OUTBOX_TEST_LEASE="2")
    try:
        wait_for(lambda: len(ran(out)) >= 2, 60, "the second send, after the lease")
        wait_for(
            lambda: Delivery.objects.get().state == State.SUCCEEDED,
            30,
            "the delivery marked",
        )
    finally:
        second.stop()
    assert ran(out) == [(str(event.id), "once")] * 2  # at most twice, one id
    assert Delivery.objects.get().attempts == 2
