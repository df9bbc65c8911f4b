"""The on-commit Celery wake-up (``OUTBOX_CELERY_WAKE``): sent with the
project's Celery app without the project importing it, never slowing a commit,
and a broker outage logged once (docs/celery.md)."""

from __future__ import annotations

import decimal
import logging
import socket
import threading
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import transaction
from kombu import Connection

from outbox_app import publish, tasks
from tests.conftest import require_service
from tests.processes import spawn, wait_for
from tests.services import RABBITMQ_URL
from tests.testapp.events import OrderPlaced

# The wake-up's hand-off does not depend on the database: SQLite pass only.
pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.any_database]

BROKER = RABBITMQ_URL

#: A web process: Django set up, Celery configured in Django's settings, the
#: project's Celery module never imported.
WEB_PROCESS = """
import os, django
django.setup()
from django.conf import settings
settings.OUTBOX_CELERY_WAKE = True
settings.CELERY_BROKER_URL = os.environ["WAKE_BROKER"]
settings.CELERY_TASK_DEFAULT_QUEUE = os.environ["WAKE_QUEUE"]
if os.environ.get("WAKE_APP"):
    settings.OUTBOX_CELERY_APP = os.environ["WAKE_APP"]
from django.db import transaction
from outbox_app import publish
from tests.testapp.events import OrderPlaced
with transaction.atomic():
    publish(OrderPlaced(order_id=1, total=1))
import celery
print(celery.current_app.main)
"""


@pytest.fixture(autouse=True)
def waker(monkeypatch):
    """A waker of the test's own: no outage state carried over."""
    monkeypatch.setattr(tasks, "_waker", tasks.Waker())


@pytest.fixture
def queue():
    """A queue of its own on the real RabbitMQ; deleted afterwards."""
    require_service("rabbitmq")
    name = f"outbox-wake-{uuid.uuid4().hex[:8]}"
    yield name
    with Connection(BROKER) as conn:
        conn.default_channel.queue_delete(name)


def tasks_in(queue: str, count: int) -> list[dict]:
    """Waits for ``count`` Celery task messages in ``queue``; their headers."""
    found: list[dict] = []
    with Connection(BROKER) as conn:
        channel = conn.default_channel

        def arrived() -> bool:
            try:
                message = channel.basic_get(queue, no_ack=True)
            except conn.channel_errors:  # not declared yet
                return False
            if message is not None:
                found.append(message.headers)
            return len(found) >= count

        wait_for(arrived, 20, f"{count} task message(s) in {queue}")
    return found


@pytest.mark.services("rabbitmq")
def test_web_process_wakes_the_project_app_without_importing_it(queue):
    """Celery's current app in a web process is its fallback (localhost,
    queue ``celery``); the wake-up goes to the app of the CELERY_* settings."""
    process = spawn(
        "-c",
        WEB_PROCESS,
        OUTBOX_TEST_HANDLER_SETS="record",
        WAKE_BROKER=BROKER,
        WAKE_QUEUE=queue,
    )
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    assert out.strip() == "default"  # the project's app was never imported
    [headers] = tasks_in(queue, 1)
    assert headers["task"] == tasks.RUN_HANDLERS
    assert headers["kwargsrepr"] == "{'using': 'default'}"


@pytest.mark.services("rabbitmq")
def test_outbox_celery_app_names_the_app(queue):
    process = spawn(
        "-c",
        WEB_PROCESS,
        OUTBOX_TEST_HANDLER_SETS="record",
        WAKE_BROKER="amqp://guest:guest@127.0.0.1:1//",  # not this one
        WAKE_QUEUE="not-this-one",
        WAKE_APP="tests.celery_app.app",
        OUTBOX_TEST_CELERY_QUEUE=queue,
    )
    _, err = process.communicate(timeout=60)
    assert process.returncode == 0, err
    [headers] = tasks_in(queue, 1)
    assert headers["task"] == tasks.RUN_HANDLERS


class SilentBroker:
    """A TCP server that accepts connections and never answers: a broker
    stalled or behind a black hole. Records whether each client still holds
    its connection open."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.clients: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            with self.lock:
                if self.closed:
                    client.close()
                    return
                self.clients.append(client)

    def client_open(self, client: socket.socket) -> bool:
        client.setblocking(False)
        try:
            while data := client.recv(4096):  # the AMQP protocol header
                del data
            return False  # b"": the client closed it
        except BlockingIOError:
            return True

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.server.close()
            for client in self.clients:
                client.close()


def test_a_stalled_broker_never_holds_a_commit(settings, handlers):
    """The commit returns while the wake-up's connection still waits for the
    broker's first answer: it was handed to the waker's thread (a wake-up sent
    in the committing thread returns only after its connect timeout, the
    connection closed)."""
    handlers("record")
    broker = SilentBroker()
    settings.OUTBOX_CELERY_WAKE = True
    settings.CELERY_BROKER_URL = f"amqp://guest:guest@127.0.0.1:{broker.port}//"
    settings.CELERY_BROKER_CONNECTION_TIMEOUT = 5  # seconds, retries included
    try:
        with transaction.atomic():
            publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
        wait_for(lambda: broker.clients, 10, "the wake-up's connection")
        assert broker.client_open(broker.clients[0])
    finally:
        broker.close()
        assert tasks.flush_wakeups(20)


@pytest.mark.services("rabbitmq")
def test_a_broker_outage_is_logged_once(settings, handlers, caplog, queue):
    handlers("record")
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once closed
    settings.OUTBOX_CELERY_WAKE = True
    settings.CELERY_BROKER_URL = f"amqp://guest:guest@127.0.0.1:{port}//"
    settings.CELERY_TASK_DEFAULT_QUEUE = queue
    settings.CELERY_BROKER_CONNECTION_TIMEOUT = 0.5  # seconds, retries included
    caplog.set_level(logging.WARNING, logger="outbox_app.tasks")
    for i in range(3):
        with transaction.atomic():
            publish(OrderPlaced(order_id=i, total=decimal.Decimal(1)))
        assert tasks.flush_wakeups(10)
    assert [r.getMessage()[:26] for r in caplog.records] == [
        "outbox wake-up not sent (O"
    ]

    settings.CELERY_BROKER_URL = BROKER  # the broker is back
    with transaction.atomic():
        publish(OrderPlaced(order_id=9, total=decimal.Decimal(1)))
    assert tasks.flush_wakeups(10)
    assert caplog.records[-1].getMessage() == "outbox wake-ups are sent again"
    assert len(tasks_in(queue, 1)) == 1


def test_checks_name_a_bad_celery_app(settings):
    settings.OUTBOX_CELERY_WAKE = True
    settings.OUTBOX_CELERY_APP = "tests.no_such_module.app"
    with pytest.raises(SystemCheckError, match="outbox.E017"):
        call_command("check")
    settings.OUTBOX_CELERY_APP = "tests.settings.OUTBOX_PUBLISHERS"
    with pytest.raises(SystemCheckError, match="not a Celery app"):
        call_command("check")


def test_checks_warn_when_wakeups_would_go_to_celerys_default_broker(settings):
    settings.OUTBOX_CELERY_WAKE = True
    if hasattr(settings, "CELERY_BROKER_URL"):
        del settings.CELERY_BROKER_URL
    from outbox_app.ops.checks import check_settings

    assert [m.id for m in check_settings()] == ["outbox.W004"]
    settings.CELERY_BROKER_URL = BROKER
    assert check_settings() == []


@pytest.mark.parametrize(
    "url",
    [
        "amqp://guest:s3cret@127.0.0.1:notaport//",
        "amqp://guest:s3cret@[127.0.0.1//",
        "redis://:s3cret@127.0.0.1:notaport/0",
    ],
)
def test_a_malformed_broker_url_is_masked_in_the_log(settings, handlers, caplog, url):
    handlers("record")
    settings.OUTBOX_CELERY_WAKE = True
    settings.CELERY_BROKER_URL = url
    settings.CELERY_BROKER_CONNECTION_TIMEOUT = 0.5
    caplog.set_level(logging.WARNING, logger="outbox_app.tasks")
    with transaction.atomic():
        publish(OrderPlaced(order_id=1, total=decimal.Decimal(1)))
    assert tasks.flush_wakeups(10)
    [record] = caplog.records
    assert "outbox wake-up not sent" in record.getMessage()
    assert "s3cret" not in record.getMessage()
