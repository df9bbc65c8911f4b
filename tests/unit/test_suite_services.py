"""The suite's brokers come from the environment (tests/services.py): a run
can be kept off a shared broker, and a service counts as there only when its
URL answers (a vhost that does not exist is not a RabbitMQ to test on)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.services import address, through

ROOT = Path(__file__).resolve().parents[2]


def python(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python ARGS`` in the repository, with ``env``, its output captured."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.parametrize(
    ("url", "port", "expected"),
    [
        ("amqp://guest:guest@127.0.0.1:5672//", 4000, "amqp://guest:guest@127.0.0.1:4000//"),
        ("amqp://u:p@rabbit/tests", 4000, "amqp://u:p@127.0.0.1:4000/tests"),
        ("redis://:s3cret@cache:6380/5", 4001, "redis://:s3cret@127.0.0.1:4001/5"),
        ("nats://127.0.0.1:4222", 4002, "nats://127.0.0.1:4002"),
    ],
)  # fmt: skip
def test_a_proxy_keeps_the_credentials_and_the_vhost_or_database(url, port, expected):
    assert through(url, port) == expected


def test_a_url_without_a_port_means_the_schemes():
    assert address("amqp://guest:guest@rabbit/tests") == ("rabbit", 5672)
    assert address("redis://cache/3") == ("cache", 6379)
    assert address("nats://n1") == ("n1", 4222)


@pytest.mark.slow
@pytest.mark.services("rabbitmq", "redis")
def test_the_broker_tests_use_the_urls_of_the_environment(tmp_path):
    """With OUTBOX_TEST_RABBITMQ_URL naming a vhost that does not exist and
    OUTBOX_TEST_REDIS_URL a database Redis does not have, the broker tests do
    not run on the default vhost and database (their port is open): they are
    deselected, and the summary names the URLs it tried."""
    vhost = f"outbox-no-such-vhost-{uuid.uuid4().hex[:8]}"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("OUTBOX_REQUIRE_SERVICES", "DATABASE_URL")
    }
    env.update(
        OUTBOX_TEST_RABBITMQ_URL=f"amqp://guest:guest@127.0.0.1:5672/{vhost}",
        OUTBOX_TEST_REDIS_URL="redis://127.0.0.1:6379/999",
        OUTBOX_TEST_SQLITE_DIR=str(tmp_path),
    )
    ran = python(
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-q",
        "tests/brokers/test_rabbitmq.py",
        "tests/brokers/test_redis.py",
        env=env,
    )
    out = ran.stdout
    assert ran.returncode == 0 and " failed" not in out, out[-3000:]
    assert (
        f"RabbitMQ is not reachable: amqp://guest:**@127.0.0.1:5672/{vhost} "
        "(OUTBOX_TEST_RABBITMQ_URL)" in out
    ), out[-3000:]
    assert (
        "Redis is not reachable: redis://127.0.0.1:6379/999 (OUTBOX_TEST_REDIS_URL)"
        in out
    ), out[-3000:]


@pytest.mark.slow
def test_the_unit_tests_that_need_nats_skip_where_it_is_not_installed(tmp_path):
    """nats-py is an extra (``outbox_app[nats]``): on a machine without it,
    the unit tests that build a NATS publisher are skipped, saying why, and
    the others pass."""
    run = (
        "import sys; sys.modules['nats'] = None; import pytest; "
        "sys.exit(pytest.main(['-p', 'no:cacheprovider', '-q', '-rs', "
        "'tests/unit/test_checks.py']))"
    )
    env = {
        **{k: v for k, v in os.environ.items() if k != "DATABASE_URL"},
        "OUTBOX_TEST_SQLITE_DIR": str(tmp_path),
    }
    ran = python("-c", run, env=env)
    out = ran.stdout
    assert ran.returncode == 0, out[-3000:]
    assert "3 skipped" in out and "nats is not installed" in out, out[-3000:]
