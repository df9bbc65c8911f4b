"""Celery tasks through the outbox: ``enqueue()`` writes the task in the
caller's transaction, the relay's CeleryPublisher sends it with ``send_task``
(task id = event id), and a real worker on RabbitMQ or Redis runs it."""

from __future__ import annotations

import datetime
import decimal
import json
import math
import signal
import threading
import uuid

import pytest
from celery import chain, group, signature
from django.db import transaction
from django.utils import timezone

from outbox_app import OutboxEvent, enqueue
from outbox_app.exceptions import (
    InvalidPayload,
    NoTaskPublisher,
    OutboxRequiresActiveTransaction,
    PublisherUnavailable,
    UnsupportedTask,
    UnsupportedTaskArgument,
)
from outbox_app.ops.checks import check_settings
from outbox_app.publishers.base import build_publisher
from outbox_app.publishers.celery import CeleryPublisher
from outbox_app.publishing.enqueue import TASK_BACKEND, TASK_EVENT_TYPE
from outbox_app.store.lifecycle import State
from tests import kit
from tests.conftest import require_service
from tests.kit import free_port
from tests.processes import Watched, celery_worker, spawn, wait_for
from tests.services import RABBITMQ_URL, REDIS_URL

TASKS = {"tasks": {"BACKEND": TASK_BACKEND}}
RECORD = "tests.record_task"
RECORD_ARGUMENTS = "tests.record_arguments"


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


@pytest.mark.django_db(transaction=True)
def test_arguments_celerys_json_cannot_carry_are_refused_by_name(tasks_publisher):
    """What ``delay()`` with Celery's JSON serializer refuses (kombu's
    ``EncodeError``), and what the outbox cannot store though that JSON
    writes it (NaN), are refused by ``enqueue()`` before anything is
    written, naming the argument."""
    refused = [
        (signature(RECORD_ARGUMENTS, args=("/tmp/x", {1, 2})), "args[1]", "set"),
        (signature(RECORD_ARGUMENTS, kwargs={"who": object()}), "kwargs.who", "object"),
        (
            signature(RECORD_ARGUMENTS, args=([1.0, math.nan],)),
            "args[0]",
            "Out of range float",
        ),
    ]
    with transaction.atomic():
        for value, field, why in refused:
            with pytest.raises(UnsupportedTaskArgument, match=why) as raised:
                enqueue(value)
            assert raised.value.field == field
            # Caught as what enqueue() refused, and as an unusable payload.
            assert isinstance(raised.value, UnsupportedTask)
            assert isinstance(raised.value, InvalidPayload)
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


@pytest.mark.services("rabbitmq")
def test_a_send_ends_within_half_a_lease_when_no_confirm_comes(settings):
    """RabbitMQ stops answering in the middle of the relay's connection (its
    confirms lost, a blocked connection): ``send_task`` waited for the
    confirm without end, past the lease, while another relay took the batch
    over. The batch's sends now end within half a lease, as an outage."""
    from tests.brokers.proxy import TcpProxy

    settings.OUTBOX_LEASE_SECONDS = 4
    proxy = TcpProxy(("127.0.0.1", 5672))
    queue = f"outbox-tasks-{uuid.uuid4().hex[:8]}"
    settings.OUTBOX_CELERY_APP = None
    settings.CELERY_BROKER_URL = f"amqp://guest:guest@127.0.0.1:{proxy.port}//"
    settings.CELERY_BROKER_TRANSPORT_OPTIONS = {"confirm_publish": True}
    publisher = CeleryPublisher("tasks", {})

    def message():
        task = {"task": RECORD, "args": [], "kwargs": {}, "options": {"queue": queue}}
        return type("Message", (), {"event_id": uuid.uuid4(), "payload": task})()

    outcomes = []
    try:
        assert publisher.send_batch([message()]) == [None]  # connected, confirmed
        proxy.freeze()  # no confirm comes back
        sending = threading.Thread(
            target=lambda: outcomes.extend(publisher.send_batch([message(), message()]))
        )
        sending.start()
        sending.join(60)  # half a lease is 2 s; before, it never returned
        assert not sending.is_alive(), "the send outlived the lease"
    finally:
        proxy.thaw()
        proxy.close()
        publisher.close()
        with publisher.app.connection_for_write(BROKERS["rabbitmq"]) as connection:
            connection.default_channel.queue_delete(queue)
    assert [type(o) for o in outcomes] == [PublisherUnavailable] * 2
    assert "2 s" in str(outcomes[0])


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


def relay_until_delivered(env: dict, out, count: int, **more: str) -> None:
    """A relay process runs until the worker ran ``count`` tasks (recorded in
    ``out``) and their deliveries are done."""
    process = relay(env, **more)
    try:
        wait_for(lambda: len(ran(out)) >= count, 60, f"the worker to run {count} tasks")
        wait_for(lambda: kit.succeeded() == count, 30, "the deliveries marked")
    finally:
        process.stop()


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
    relay_until_delivered(broker, out, 3)
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
    assert kit.taken()  # sent, never recorded
    second = relay(broker, OUTBOX_TEST_LEASE="2")
    try:
        wait_for(lambda: len(ran(out)) >= 2, 60, "the second send, after the lease")
        wait_for(lambda: kit.succeeded() == 1, 30, "the delivery marked")
    finally:
        second.stop()
    assert ran(out) == [(str(event.id), "once")] * 2  # at most twice, one id


#: Arguments ``str()`` would flatten: Celery's JSON serializer (kombu's)
#: carries each as its own type.
TYPED_ARGUMENTS = (
    decimal.Decimal("19.90"),
    uuid.UUID("0f8fad5b-d9cb-469f-a165-70867728950e"),
    datetime.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo=datetime.UTC),
    datetime.datetime(2026, 1, 2, 3, 4, 5),
    datetime.date(2026, 1, 2),
    datetime.time(3, 4, 5, 6),
    b"raw \xff bytes",
    ("a", "tuple"),
    {"nested": [decimal.Decimal("0.1"), {"at": datetime.date(2026, 2, 3)}]},
)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_the_task_receives_the_arguments_delay_would_give_it(
    broker, tmp_path, settings
):
    """Decimal, UUID, datetime, date, time and bytes reach the task as those
    types (``enqueue()`` wrote them as strings before), exactly as the same
    call's ``delay()`` gives them, on RabbitMQ and on Redis."""
    from celery import Celery

    settings.OUTBOX_PUBLISHERS = TASKS
    out = tmp_path / "ran"
    kwargs = {"amount": decimal.Decimal("1.50"), "when": TYPED_ARGUMENTS[2]}
    with transaction.atomic():
        event = enqueue(
            signature(
                RECORD_ARGUMENTS, args=(str(out), *TYPED_ARGUMENTS), kwargs=kwargs
            )
        )
    direct = Celery("delay", set_as_current=False)
    direct.conf.update(
        broker_url=broker["OUTBOX_TEST_CELERY_BROKER"],
        task_default_queue=broker["OUTBOX_TEST_CELERY_QUEUE"],
    )
    delayed = direct.signature(
        RECORD_ARGUMENTS, args=(str(out), *TYPED_ARGUMENTS), kwargs=kwargs
    ).delay()
    process = relay(broker)
    try:
        wait_for(lambda: len(ran(out)) >= 2, 60, "the worker to run both tasks")
    finally:
        process.stop()
        direct.close()
    received = dict(ran(out))
    assert received[str(event.id)] == received[delayed.id]
    assert received[str(event.id)].startswith(
        "(Decimal('19.90'), UUID('0f8fad5b-d9cb-469f-a165-70867728950e'), "
        "datetime.datetime(2026, 1, 2, 3, 4, 5, 123456, tzinfo="
    )


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_result_backend_that_is_down_costs_no_attempt(broker, tmp_path, settings):
    """Celery's Redis result backend subscribes the sender to each task's
    result: with it down, each send blocked ~19 s in its reconnect loop and
    failed ("Retry limit exceeded ... result store"), an attempt counted, DEAD
    after OUTBOX_MAX_ATTEMPTS. The relay never reads a result: its sends
    leave the result backend alone, and the tasks run."""
    settings.OUTBOX_PUBLISHERS = TASKS
    out = tmp_path / "ran"
    with transaction.atomic():
        events = [enqueue(signature(RECORD, args=(str(out), i))) for i in range(3)]
    down = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    relay_until_delivered(broker, out, 3, OUTBOX_TEST_CELERY_RESULT_BACKEND=down)
    assert sorted(ran(out)) == sorted((str(e.id), str(i)) for i, e in enumerate(events))
    assert kit.states() == {State.SUCCEEDED: 3}  # no attempt failed
