"""The Celery app of the tests' worker and beat processes.

Celery's Django fix-up sets Django up in the worker (DJANGO_SETTINGS_MODULE).
"""

import os

from celery import Celery

from outbox_app.tasks import beat_schedule
from tests.services import RABBITMQ_URL

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")

app = Celery("outbox_tests")
app.conf.update(
    broker_url=os.environ.get("OUTBOX_TEST_CELERY_BROKER", RABBITMQ_URL),
    # One queue per test run, so a run never sees another's messages.
    task_default_queue=os.environ.setdefault(
        "OUTBOX_TEST_CELERY_QUEUE", f"outbox-tests-{os.getpid()}"
    ),
    beat_schedule=beat_schedule(
        interval=float(os.environ.get("OUTBOX_TEST_BEAT_INTERVAL", "1.0"))
    ),
    # None (the default): no result backend.
    result_backend=os.environ.get("OUTBOX_TEST_CELERY_RESULT_BACKEND"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
app.autodiscover_tasks(["outbox_app"])


@app.task(name="tests.record_task", bind=True)
def record_task(self, path: str, value) -> None:
    """Append ``<task id> <value>`` to the file ``path``: what ran, and as what."""
    with open(path, "a") as file:
        file.write(f"{self.request.id} {value}\n")


@app.task(name="tests.record_arguments", bind=True)
def record_arguments(self, path: str, *args, **kwargs) -> None:
    """Append ``<task id> <repr of args and kwargs>`` to the file ``path``: the
    arguments as the task received them, types included."""
    with open(path, "a") as file:
        file.write(f"{self.request.id} {args!r} {sorted(kwargs.items())!r}\n")
