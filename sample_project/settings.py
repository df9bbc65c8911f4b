"""The sample shop's settings, read from the environment (django-environ).

Defaults run on a bare machine: SQLite (WAL) next to manage.py, in-process
handlers, and kombu's in-memory transport (``memory://``) as the broker
publisher's URL. Set ``DATABASE_URL``, ``OUTBOX_BROKER_URL`` and
``CELERY_BROKER_URL`` to try PostgreSQL, MariaDB, RabbitMQ or Redis.

Environment:
    DATABASE_URL: django-environ database URL (default: sqlite sample.sqlite3).
    OUTBOX_BROKER_URL: kombu URL the "broker" publisher sends every event to
        (default ``memory://``: in-process, lost on exit).
    SHOP_EVENTS_EXCHANGE: its topic exchange (default ``shop.events``);
        ``manage.py consume`` reads queue ``<exchange>.all`` from the same
        broker (``shop/consumers.py``).
    SHOP_NATS_URL: when set (e.g. ``nats://127.0.0.1:4222``), a second
        publisher, "nats", sends every event to NATS JetStream too
        (``JetStreamPublisher``, needs ``outbox_app[nats]``): subject
        ``shop.<event type>``, in a stream it creates (or updates) capturing
        ``shop.>``, whose duplicate window (twice the lease, at least 120 s)
        keeps a relay's resend after a crash out of the stream.
    SHOP_NATS_STREAM: that stream's name (default ``SHOP_EVENTS``).
    SHOP_NATS_SUBJECT_PREFIX: the subjects' first token (default ``shop``);
        two streams cannot capture the same subjects, so another shop on the
        same server (a test) needs its own.
    OUTBOX_LEASE_SECONDS: how long a relay holds the rows it claimed (default
        60): a crashed relay's rows are sent again after it.
    OUTBOX_BATCH_SIZE, OUTBOX_POLL_INTERVAL_SECONDS, OUTBOX_MAX_ATTEMPTS: the relay's.
    CELERY_BROKER_URL, CELERY_TASK_DEFAULT_QUEUE, OUTBOX_CELERY_WAKE: Celery
        (sample_project/celery.py).
    EMAIL_BACKEND: where confirmation e-mails go (default locmem: kept in
        memory, never printed, so a 10,000-order simulation stays quiet; use
        django.core.mail.backends.console.EmailBackend to see them).
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env(DEBUG=(bool, True))

SECRET_KEY = env("SECRET_KEY", default="sample-project-not-secret")
DEBUG = env("DEBUG")
ALLOWED_HOSTS = env.list("ALLOWED_HOSTS", default=["localhost", "127.0.0.1"])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "outbox_app",
    "sample_project.shop",
]
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
]
ROOT_URLCONF = "sample_project.urls"
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
WSGI_APPLICATION = "sample_project.wsgi.application"

DATABASES = {
    "default": env.db_url(
        "DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'sample.sqlite3'}"
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }

USE_TZ = True
TIME_ZONE = "UTC"
LANGUAGE_CODE = "en-us"
STATIC_URL = "static/"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- outbox_app -------------------------------------------------------------------
OUTBOX_NAMESPACE = "sample-shop"
OUTBOX_BATCH_SIZE = env.int("OUTBOX_BATCH_SIZE", default=100)
OUTBOX_POLL_INTERVAL_SECONDS = env.float("OUTBOX_POLL_INTERVAL_SECONDS", default=1.0)
OUTBOX_MAX_ATTEMPTS = env.int("OUTBOX_MAX_ATTEMPTS", default=10)
OUTBOX_LEASE_SECONDS = env.float("OUTBOX_LEASE_SECONDS", default=60.0)
SHOP_BROKER_URL = env("OUTBOX_BROKER_URL", default="memory://")
SHOP_EVENTS_EXCHANGE = env("SHOP_EVENTS_EXCHANGE", default="shop.events")
SHOP_EVENTS_QUEUE = f"{SHOP_EVENTS_EXCHANGE}.all"
OUTBOX_PUBLISHERS = {
    "broker": {
        "URL": SHOP_BROKER_URL,
        "EXCHANGE": SHOP_EVENTS_EXCHANGE,
        "ROUTING_KEY": "{aggregate_type}.{event_type}",
        "DECLARE": [SHOP_EVENTS_QUEUE],
    }
}
# The catalog's change events in the CoreWrite format, on a fanout exchange of
# their own: every subscriber's queue (sample_consumer/search_indexer.py's
# search-indexer) gets each one.
SHOP_CATALOG_EXCHANGE = env("SHOP_CATALOG_EXCHANGE", default="shop.catalog")
OUTBOX_PUBLISHERS["catalog"] = {
    "URL": SHOP_BROKER_URL,
    "EXCHANGE": SHOP_CATALOG_EXCHANGE,
    "EXCHANGE_TYPE": "fanout",
    "FORMAT": "corewrite",
    "ORDERED": True,  # each listing's events in the order they happened
    "EVENT_TYPES": [
        "ListingCreated",
        "ListingUpdated",
        "ListingDeleted",
        "ListingForceDeleted",
    ],
}
SHOP_NATS_URL = env("SHOP_NATS_URL", default="")
SHOP_NATS_STREAM = env("SHOP_NATS_STREAM", default="SHOP_EVENTS")
SHOP_NATS_SUBJECT_PREFIX = env("SHOP_NATS_SUBJECT_PREFIX", default="shop")
if SHOP_NATS_URL:
    OUTBOX_PUBLISHERS["nats"] = {
        "BACKEND": "outbox_app.publishers.nats.JetStreamPublisher",
        "URL": SHOP_NATS_URL,
        "STREAM": SHOP_NATS_STREAM,
        "SUBJECT": SHOP_NATS_SUBJECT_PREFIX + ".{event_type}",  # shop.OrderPlaced
        "DECLARE": True,
        "STREAM_SUBJECTS": [f"{SHOP_NATS_SUBJECT_PREFIX}.>"],
        # Above the lease: a crashed relay's batch, sent again once its lease
        # ran out, is dropped by the stream as a duplicate (Nats-Msg-Id).
        "DUPLICATE_WINDOW": max(120.0, 2 * OUTBOX_LEASE_SECONDS),
    }
# The receiving end (manage.py consume, shop/consumers.py): the same broker.
OUTBOX_INBOX_URL = SHOP_BROKER_URL
OUTBOX_INBOX_EXCHANGE = SHOP_EVENTS_EXCHANGE
OUTBOX_CELERY_WAKE = env.bool("OUTBOX_CELERY_WAKE", default=False)
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="memory://")
CELERY_TASK_DEFAULT_QUEUE = env("CELERY_TASK_DEFAULT_QUEUE", default="celery")

EMAIL_BACKEND = env(
    "EMAIL_BACKEND", default="django.core.mail.backends.locmem.EmailBackend"
)

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # python manage.py relay -v 2 shows the relay's INFO lines.
    "loggers": {"outbox_app": {"handlers": ["console"], "level": "WARNING"}},
}
