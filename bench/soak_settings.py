"""The soak's project settings (``bench/soak.py``): a fresh project as a user
has it, plus only what the soak needs.

- ``DATABASES`` from ``DATABASE_URL`` (django-environ; PostgreSQL or
  MySQL/MariaDB, ``charset`` utf8mb4 on the latter);
- the apps (``bench.soakapp``: the event, its handlers, their effects),
  ``OUTBOX_NAMESPACE = "soak"``;
- one RabbitMQ publisher, ``soak.broker``, to ``$SOAK_BROKER_URL``, exchange
  and durable queue ``soak.events`` (``DECLARE``); every other option at
  its default; with ``$SOAK_KAFKA_SERVERS`` set (``--broker kafka``), a
  Kafka publisher ``soak.broker`` to those servers instead, topic
  ``soak.events``, every other option at its default;
- ``OUTBOX_LEASE_SECONDS`` from ``$SOAK_LEASE_SECONDS`` (seconds) when set
  (the ``--lease`` option: a stall past the lease then takes seconds, not a
  minute); otherwise the default;
- ``OUTBOX_ENGINE`` from ``$OUTBOX_ENGINE`` when set (``stream`` or
  ``rows``, the delivery engine the soak judges); otherwise the default:
  stream delivery on PostgreSQL, rows on MySQL/MariaDB.

Every other ``OUTBOX_*`` setting keeps its default. For diagnosis only, a
process with these settings writes the stack of each of its threads to stderr
(the relay's log) when it receives SIGUSR1 (``faulthandler``): the soak sends
it to relays that do not drain or do not stop.

    DATABASE_URL=postgres://postgres@127.0.0.1:5432/outbox_soak \\
    SOAK_BROKER_URL=amqp://guest:guest@127.0.0.1:5672/outbox_soak \\
        .venv/bin/python -m django relay --settings bench.soak_settings
"""

import faulthandler
import os
import signal

import environ

faulthandler.register(signal.SIGUSR1, all_threads=True)

env = environ.Env()

SECRET_KEY = "soak-only-not-secret"
DEBUG = False
USE_TZ = True
TIME_ZONE = "UTC"

DATABASES = {
    "default": env.db_url(
        "DATABASE_URL", default="postgres://postgres@127.0.0.1:5432/outbox_soak"
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.mysql":
    DATABASES["default"].setdefault("OPTIONS", {})["charset"] = "utf8mb4"

INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "outbox_app",
    "bench.soakapp",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

#: The exchange, and the queue bound to it with "#", that the soak consumes.
SOAK_EXCHANGE = SOAK_QUEUE = "soak.events"

OUTBOX_NAMESPACE = "soak"
RABBITMQ_URL = os.environ.get(
    "SOAK_BROKER_URL", "amqp://guest:guest@127.0.0.1:5672/outbox_soak"
)
OUTBOX_PUBLISHERS = {
    "soak.broker": {
        "URL": RABBITMQ_URL,
        "EXCHANGE": SOAK_EXCHANGE,
        "DECLARE": [SOAK_QUEUE],
    }
}
if os.environ.get("SOAK_KAFKA_SERVERS"):  # python -m bench.soak --broker kafka
    OUTBOX_PUBLISHERS = {
        "soak.broker": {
            "BACKEND": "outbox_app.publishers.kafka.KafkaPublisher",
            "BOOTSTRAP_SERVERS": os.environ["SOAK_KAFKA_SERVERS"],
            "TOPIC": SOAK_QUEUE,
        }
    }
if os.environ.get("SOAK_LEASE_SECONDS"):
    OUTBOX_LEASE_SECONDS = float(os.environ["SOAK_LEASE_SECONDS"])
if os.environ.get("OUTBOX_ENGINE"):
    OUTBOX_ENGINE = os.environ["OUTBOX_ENGINE"]

# ``manage.py consume`` (the soak's consumer process, bench/soakapp/consumers.py)
# reads the relays' exchange from the same vhost (not run against Kafka).
OUTBOX_INBOX_URL = RABBITMQ_URL
OUTBOX_INBOX_EXCHANGE = SOAK_EXCHANGE
