"""Where the brokers the tests talk to are: read from the environment, so a
test run can be kept off a shared broker (a RabbitMQ vhost, a Redis database
of its own), with the services on loopback as the defaults.

    OUTBOX_TEST_RABBITMQ_URL  amqp://guest:guest@127.0.0.1:5672//
    OUTBOX_TEST_REDIS_URL     redis://127.0.0.1:6379/0
    OUTBOX_TEST_NATS_URL      nats://127.0.0.1:4222

(``OUTBOX_TEST_CELERY_BROKER``, the tests' Celery broker, defaults to the
RabbitMQ one.) A service counts as there when its URL answers: RabbitMQ and
Redis by a connection that logs in (so a missing vhost, wrong credentials or
a Redis database out of range say so), NATS by its port. No Django or pytest
here: the tests' Celery app and processes import it.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

RABBITMQ_URL = os.environ.get(
    "OUTBOX_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"
)
REDIS_URL = os.environ.get("OUTBOX_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
NATS_URL = os.environ.get("OUTBOX_TEST_NATS_URL", "nats://127.0.0.1:4222")

#: The port a URL without one means, by scheme.
DEFAULT_PORTS = {"amqp": 5672, "amqps": 5671, "redis": 6379, "nats": 4222}


def address(url: str) -> tuple[str, int]:
    """``(host, port)`` of a broker URL (the scheme's port when it has none)."""
    parts = urllib.parse.urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or DEFAULT_PORTS[parts.scheme]


def through(url: str, port: int, host: str = "127.0.0.1") -> str:
    """``url`` with its host and port replaced (a proxy in front of the broker,
    or a closed port), its credentials, vhost or database kept."""
    parts = urllib.parse.urlsplit(url)
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@{host}:{port}" if credentials else f"{host}:{port}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def port_open(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=2).close()
    except OSError:
        return False
    return True


def kombu_answers(url: str) -> bool:
    """A kombu connection to ``url`` opens (for AMQP: logged in to its vhost)
    and a channel on it works."""
    from kombu import Connection

    if not port_open(address(url)):
        return False
    try:
        with Connection(url, connect_timeout=2) as connection:
            connection.ensure_connection(max_retries=1)
            connection.default_channel  # noqa: B018 (opens it: Redis's SELECT)
            if url.startswith("redis"):
                connection.default_channel.client.ping()
    except Exception:
        return False
    return True
