"""Celery for the sample shop (optional): the relay as beat tasks.

    CELERY_BROKER_URL=amqp://guest:guest@127.0.0.1:5672// \\
        celery -A sample_project worker --beat --loglevel INFO

``CELERY_RELAY_RUNS`` (default 1) schedules that many relay runs of each kind
per second, to run side by side in a worker with as many processes
(PostgreSQL and MySQL/MariaDB only: their claims skip each other's rows).
``python manage.py relay`` does the same job without Celery.
"""

import os

from celery import Celery

from outbox_app.tasks import beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample_project.settings")

app = Celery("sample_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
_relay_runs = beat_schedule(interval=1.0)
app.conf.beat_schedule = {
    **app.conf.beat_schedule,
    **{
        f"{name}-{run}": entry
        for run in range(int(os.environ.get("CELERY_RELAY_RUNS", "1")))
        for name, entry in _relay_runs.items()
        if run == 0 or name != "outbox-purge"
    },
}
