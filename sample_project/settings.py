"""The sample shop's settings, read from the environment (django-environ).

Defaults run on a bare machine: SQLite next to manage.py, in-process handlers,
no broker. Set ``DATABASE_URL`` and ``CELERY_BROKER_URL`` /
``OUTBOX_BROKER_URL`` to try PostgreSQL, MariaDB, RabbitMQ or Redis.
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
# In-process handlers only by default. Set OUTBOX_BROKER_URL (for example
# amqp://guest:guest@127.0.0.1:5672// or redis://127.0.0.1:6379/0) to also
# publish every event to a broker.
_broker_url = env("OUTBOX_BROKER_URL", default="")
OUTBOX_PUBLISHERS = (
    {
        "broker": {
            "URL": _broker_url,
            "EXCHANGE": "shop.events",
            "ROUTING_KEY": "{aggregate_type}.{event_type}",
            "DECLARE": ["shop.events.all"],
        }
    }
    if _broker_url
    else {}
)
OUTBOX_CELERY_WAKE = env.bool("OUTBOX_CELERY_WAKE", default=False)
CELERY_BROKER_URL = env("CELERY_BROKER_URL", default="memory://")

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"console": {"class": "logging.StreamHandler"}},
    # python manage.py relay -v 2 shows the relay's INFO lines.
    "loggers": {"outbox_app": {"handlers": ["console"], "level": "WARNING"}},
}
