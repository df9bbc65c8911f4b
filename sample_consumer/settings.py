"""A second Django project, the shop's billing service: it consumes the shop's
integration events from the broker with ``manage.py consume`` (outbox_app's
transactional inbox) into a database of its own, and shares no code with the
shop: its consumers receive the events as the CloudEvents' ``data``.

    export OUTBOX_BROKER_URL=amqp://guest:guest@127.0.0.1:5672//
    export DJANGO_SETTINGS_MODULE=sample_consumer.settings
    python -m django migrate
    python -m django consume

Environment:
    BILLING_DATABASE_URL: django-environ database URL (default: SQLite
        ``billing.sqlite3`` next to manage.py).
    OUTBOX_BROKER_URL: the shop's broker (the shop's own variable).
    SHOP_EVENTS_EXCHANGE: the shop's exchange (default ``shop.events``).
    BILLING_QUEUE: the queue billing reads, bound to that exchange (default
        ``billing.orders``); two billing services on one broker, each with
        its own, each get every event.
"""

from pathlib import Path

import environ

BASE_DIR = Path(__file__).resolve().parent.parent
env = environ.Env()

SECRET_KEY = env("SECRET_KEY", default="billing-sample-not-secret")
DEBUG = True
USE_TZ = True
TIME_ZONE = "UTC"
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "outbox_app",
    "sample_consumer.billing",
]
DATABASES = {
    "default": env.db_url(
        "BILLING_DATABASE_URL", default=f"sqlite:///{BASE_DIR / 'billing.sqlite3'}"
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    DATABASES["default"]["OPTIONS"] = {
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }

OUTBOX_NAMESPACE = "billing"
OUTBOX_INBOX_URL = env(
    "OUTBOX_BROKER_URL", default="amqp://guest:guest@127.0.0.1:5672//"
)
OUTBOX_INBOX_EXCHANGE = env("SHOP_EVENTS_EXCHANGE", default="shop.events")
BILLING_QUEUE = env("BILLING_QUEUE", default="billing.orders")
