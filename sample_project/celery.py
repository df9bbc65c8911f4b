"""Celery for the sample shop (optional): the relay as beat tasks.

    CELERY_BROKER_URL=amqp://guest:guest@127.0.0.1:5672// \\
        celery -A sample_project worker --beat --loglevel INFO

``python manage.py relay`` does the same job without Celery.
"""

import os

from celery import Celery

from outbox_app.tasks import beat_schedule

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "sample_project.settings")

app = Celery("sample_project")
app.config_from_object("django.conf:settings", namespace="CELERY")
app.autodiscover_tasks()
app.conf.beat_schedule = {**app.conf.beat_schedule, **beat_schedule(interval=1.0)}
