"""Settings for the test suite: one module for every database.

``DATABASE_URL`` picks the database (django-environ syntax), SQLite by default::

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox pytest
    DATABASE_URL=mysql://root@127.0.0.1:3306/outbox pytest

Beside ``default``, the shard tests (``tests/delivery/test_shards.py``) use one more
database per URL in ``OUTBOX_TEST_SHARDS`` (space-separated; aliases
``shard2``, ``shard3``, ...), any of the three databases, e.g. a second
PostgreSQL database and a MariaDB one::

    OUTBOX_TEST_SHARDS="postgres://postgres@127.0.0.1:5432/outbox_2 \
        mysql://root@127.0.0.1:3306/outbox_3" pytest tests/delivery/test_shards.py

Unset, ``shard2`` is a second database on ``default``'s server (a second
SQLite file). The test runner creates each one's test database (``test_``
and its name), and only when a selected test uses it.
"""

import json
import os
import tempfile
from pathlib import Path

import environ

env = environ.Env()
BASE_DIR = Path(__file__).resolve().parent.parent

SECRET_KEY = "tests-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"
ALLOWED_HOSTS = ["*"]

_sqlite_dir = Path(os.environ.get("OUTBOX_TEST_SQLITE_DIR", tempfile.gettempdir()))
DATABASES = {
    "default": env.db_url(
        "DATABASE_URL", default=f"sqlite:///{_sqlite_dir / 'outbox-tests.sqlite3'}"
    )
}
if os.environ.get("OUTBOX_TEST_SHARDS", "").strip():
    for _number, _url in enumerate(os.environ["OUTBOX_TEST_SHARDS"].split(), 2):
        DATABASES[f"shard{_number}"] = env.db_url_config(_url)
else:
    _name = str(DATABASES["default"]["NAME"])
    DATABASES["shard2"] = {
        **DATABASES["default"],
        "NAME": (
            _name.removesuffix(".sqlite3") + "-shard2.sqlite3"
            if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3"
            else f"{_name}_shard2"
        ),
    }
for _alias, _db in DATABASES.items():
    if "OUTBOX_TEST_CONN_MAX_AGE" in os.environ:  # relay processes: persistent
        _db["CONN_MAX_AGE"] = int(os.environ["OUTBOX_TEST_CONN_MAX_AGE"]) or None
    if _db["ENGINE"] == "django.db.backends.sqlite3":
        # A file, not :memory:, so relay worker processes share it; WAL and
        # IMMEDIATE transactions as docs/configuration.md recommends.
        _db["TEST"] = {
            "NAME": (
                os.environ.get(
                    "OUTBOX_TEST_SQLITE_NAME",
                    str(_sqlite_dir / f"outbox-test-{os.getpid()}.sqlite3"),
                )
                if _alias == "default"
                else str(_sqlite_dir / f"outbox-test-{os.getpid()}-{_alias}.sqlite3")
            )
        }
        _db["OPTIONS"] = {
            "transaction_mode": "IMMEDIATE",
            "timeout": 20,
            "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        }
    elif _db["ENGINE"] == "django.db.backends.mysql":
        _db["OPTIONS"] = {**_db.get("OPTIONS", {}), "charset": "utf8mb4"}
        _db["TEST"] = {
            **_db.get("TEST", {}),
            "CHARSET": "utf8mb4",
            "COLLATION": "utf8mb4_unicode_ci",
        }

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "outbox_app",
    "tests.testapp",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
]
ROOT_URLCONF = "tests.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

OUTBOX_NAMESPACE = "tests"
# Relay worker processes started by the tests tune these through the environment.
OUTBOX_RETRY_BASE_SECONDS = float(os.environ.get("OUTBOX_TEST_RETRY_BASE", "1.0"))
OUTBOX_RETRY_MAX_SECONDS = float(os.environ.get("OUTBOX_TEST_RETRY_MAX", "60.0"))
OUTBOX_LEASE_SECONDS = float(os.environ.get("OUTBOX_TEST_LEASE", "60.0"))
OUTBOX_POLL_INTERVAL_SECONDS = float(os.environ.get("OUTBOX_TEST_POLL", "1.0"))
# Relay processes a test starts record their publishers only when they run,
# after the test published: their stream delivery starts at the earliest
# event kept (unless the test says otherwise).
OUTBOX_PUBLISHERS = {
    name: {"START": "earliest", **options}
    for name, options in json.loads(
        os.environ.get("OUTBOX_TEST_PUBLISHERS", "{}")
    ).items()
}
# The Celery app enqueued tasks are sent with (tests/celery_app.py's).
OUTBOX_CELERY_APP = os.environ.get("OUTBOX_TEST_CELERY_APP")
# No handler of its own: records propagate to the root logger, where pytest's
# logging plugin captures them per test.
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "loggers": {"outbox_app": {"level": "WARNING"}},
}
# manage.py consume in the inbox tests: a broker, an exchange and a queue of
# the test's own (tests/testapp/consumers.py reads OUTBOX_TEST_CONSUMER_QUEUE).
OUTBOX_INBOX_URL = os.environ.get("OUTBOX_TEST_INBOX_URL")
OUTBOX_INBOX_EXCHANGE = os.environ.get("OUTBOX_TEST_INBOX_EXCHANGE", "outbox")
# The relay's prepared statements (PostgreSQL): CI runs the delivery tests a
# second time with OUTBOX_TEST_PREPARED=1.
OUTBOX_PREPARED_STATEMENTS = os.environ.get("OUTBOX_TEST_PREPARED") == "1"
# The delivery engine the suite runs on: "stream", "rows", or unset for the
# default (stream where the database has it). Relay processes the tests start
# inherit it.
OUTBOX_ENGINE = os.environ.get("OUTBOX_TEST_ENGINE") or None
OUTBOX_PARTITIONS = int(os.environ.get("OUTBOX_TEST_PARTITIONS", "1"))
