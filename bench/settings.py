"""A fresh project's settings, for ``bench/bench_users.py``: what a user who
followed the quickstart has, and nothing else.

Only ``DATABASES`` (from ``DATABASE_URL``, django-environ; on SQLite the WAL /
IMMEDIATE / busy-timeout options docs/databases.md tells users to set), the
apps, ``OUTBOX_NAMESPACE``, ``OUTBOX_PUBLISHERS`` and, for
``bench/bench_consume.py``, ``OUTBOX_INBOX_URL`` / ``_EXCHANGE`` are set: every other
``OUTBOX_*`` setting keeps its default (batch size, poll interval, lease,
retries, pause probes). ``OUTBOX_PUBLISHERS`` is read from ``$BENCH_PUBLISHERS``
(JSON), so a run can add a RabbitMQ publisher; the handlers of
``bench.benchapp`` are switched on by ``$BENCH_NOOP_HANDLER`` and
``$BENCH_LATENCY_FILE`` (``bench/benchapp/handlers.py``).

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_bench \\
        .venv/bin/python -m django relay --once --settings bench.settings
"""

import json
import os

import environ

env = environ.Env()

SECRET_KEY = "bench-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"

DATABASES = {
    "default": env.db_url("DATABASE_URL", default="sqlite:////tmp/outbox_bench.sqlite3")
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "outbox_app",
    "bench.benchapp",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

OUTBOX_NAMESPACE = "bench"
OUTBOX_PUBLISHERS = json.loads(os.environ.get("BENCH_PUBLISHERS") or "{}")
# bench/bench_consume.py: the broker and exchange manage.py consume reads.
OUTBOX_INBOX_URL = os.environ.get("BENCH_INBOX_URL")
OUTBOX_INBOX_EXCHANGE = os.environ.get("BENCH_INBOX_EXCHANGE", "outbox")
# A figure beside the defaults: OUTBOX_PREPARED_STATEMENTS=1 in the environment
# (passed on to the relay processes) turns the relay's prepared statements on.
OUTBOX_PREPARED_STATEMENTS = os.environ.get("OUTBOX_PREPARED_STATEMENTS") == "1"
# A figure of either delivery engine: OUTBOX_ENGINE=stream or rows in the
# environment (passed on to the relay processes); unset: the default.
if os.environ.get("OUTBOX_ENGINE"):
    OUTBOX_ENGINE = os.environ["OUTBOX_ENGINE"]
# Stream delivery's partitions per subscriber (scale-out: several relays).
if os.environ.get("OUTBOX_PARTITIONS"):
    OUTBOX_PARTITIONS = int(os.environ["OUTBOX_PARTITIONS"])
