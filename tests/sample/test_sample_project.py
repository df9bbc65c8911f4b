"""The sample shop end to end, in subprocesses (its event types clash with
tests.testapp's): migrate, ``simulate`` with a clean reconciliation, the
business-rule dead letter, and ``manage.py consume`` deduplication on RabbitMQ.

With DATABASE_URL on PostgreSQL or MariaDB the shop runs on a database of the
same vendor named ``<name>_sample``; otherwise on a SQLite file in /tmp.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import environ
import pytest

from tests.conftest import require_service
from tests.kit import manage
from tests.processes import Watched
from tests.services import RABBITMQ_URL

#: The shop runs on a database of the vendor under test (see above).
pytestmark = pytest.mark.every_database

ROOT = Path(__file__).resolve().parents[2]
RABBITMQ = RABBITMQ_URL


def _admin(config: dict, sql: str) -> None:
    """Run one statement on the suite's database server, outside any database."""
    if config["ENGINE"].endswith("postgresql"):
        import psycopg

        with psycopg.connect(
            host=config["HOST"],
            port=config["PORT"] or 5432,
            user=config["USER"],
            password=config["PASSWORD"],
            dbname="postgres",
            autocommit=True,
        ) as connection:
            connection.execute(sql)
    else:
        import MySQLdb

        connection = MySQLdb.connect(
            host=config["HOST"],
            port=int(config["PORT"] or 3306),
            user=config["USER"],
            password=config["PASSWORD"],
        )
        try:
            connection.cursor().execute(sql)
        finally:
            connection.close()


@pytest.fixture(scope="module")
def shop_env(tmp_path_factory):
    """Environment for the sample project on a fresh, migrated database."""
    url = os.environ.get("DATABASE_URL", "")
    config = environ.Env.db_url_config(url) if url else {"ENGINE": "sqlite3"}
    server = config["ENGINE"].endswith(("postgresql", "mysql"))
    if server:
        name = f"{config['NAME']}_sample"
        scheme, rest = url.split("://", 1)
        sample_url = f"{scheme}://{rest.rsplit('/', 1)[0]}/{name}"
        drop = f"DROP DATABASE IF EXISTS {name}"
        if config["ENGINE"].endswith("postgresql"):
            drop += " WITH (FORCE)"
        _admin(config, drop)
        _admin(config, f"CREATE DATABASE {name}")
    else:
        sample_url = f"sqlite:////tmp/sample-{uuid.uuid4().hex[:12]}.sqlite3"
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": sample_url,
        "OUTBOX_BROKER_URL": "memory://",
        "SHOP_EVENTS_EXCHANGE": f"shop.events.test{uuid.uuid4().hex[:8]}",
    }
    _manage(env, "migrate", "-v0")
    yield env
    if server:
        _admin(config, drop)
    else:
        for suffix in ("", "-wal", "-shm"):
            Path(sample_url.removeprefix("sqlite:///") + suffix).unlink(missing_ok=True)


def _manage(env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``manage.py ARGS`` of the sample project with ``env``."""
    return manage(*args, env=env, check=check)


@pytest.fixture(scope="module")
def simulation(shop_env) -> subprocess.CompletedProcess:
    return _manage(
        shop_env, "simulate", "--orders", "50", "--failure-rate", "0.2", check=False
    )


def test_simulate_reconciles(simulation):
    assert simulation.returncode == 0, simulation.stdout + simulation.stderr
    assert "reconciliation: OK" in simulation.stdout
    assert "50/50 orders" in simulation.stderr


def test_expected_dead_letters_are_counted_not_logged(simulation):
    """The payments shop.fraud_check rejects on purpose are the table's
    dead(exp), not ERROR lines written over the progress bar: stderr holds
    the progress bar and the wait, nothing else."""
    assert simulation.returncode == 0, simulation.stdout + simulation.stderr
    shown = [part for part in re.split(r"[\r\n]", simulation.stderr) if part.strip()]
    progress = re.compile(
        r"\[[#.]{30}\] \d+/\d+ orders|waiting for delivery: \d+ outstanding\s*"
    )
    assert shown and all(progress.fullmatch(part) for part in shown), shown


def test_the_shop_s_own_tests_pass(shop_env):
    """The shop's tests (sample_project/shop/tests.py in Django's TestCase,
    test_api.py with pytest-django and outbox_app.testing's fixtures), on the
    database under test: by Django's runner and by pytest."""
    django = _manage(shop_env, "test", "sample_project.shop", "--noinput", check=False)
    assert django.returncode == 0, django.stderr
    assert re.search(r"^Ran [1-9]\d* tests", django.stderr, flags=re.M), django.stderr
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "sample_project"],
        cwd=ROOT,
        env=shop_env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stdout + ran.stderr
    assert re.search(r"\b[1-9]\d* passed", ran.stdout), ran.stdout


def test_business_rule_failure_expires_as_expected(shop_env, simulation):
    assert simulation.returncode == 0, simulation.stdout + simulation.stderr
    row = next(
        line.split()
        for line in simulation.stdout.splitlines()
        if line.startswith("shop.fraud_check")
    )
    expected, delivered, dead_expected, dead_unexpected = map(int, row[1:5])
    assert dead_expected > 0 and dead_unexpected == 0
    assert delivered + dead_expected == expected
    states = _manage(
        shop_env,
        "shell",
        "-c",
        (
            "from outbox_app import Delivery; import json; print(json.dumps(sorted("
            "set(Delivery.objects.filter(subscriber='shop.fraud_check')"
            ".exclude(state='SUCCEEDED').values_list('state', 'attempts', "
            "'last_error_type')))))"
        ),
    ).stdout
    dead_letters = json.loads(states.splitlines()[-1])
    assert dead_letters, "no dead letter to requeue"
    for state, attempts, error_type in dead_letters:
        assert (state, attempts) == ("DEAD", 1)
        assert error_type.endswith("PaymentFlagged")


@pytest.mark.services("rabbitmq")
def test_consume_drops_redeliveries(shop_env):
    require_service("rabbitmq")
    from kombu import Connection, Exchange, Queue

    env = {**shop_env, "OUTBOX_BROKER_URL": RABBITMQ}
    name = env["SHOP_EVENTS_EXCHANGE"]
    exchange = Exchange(name, "topic", durable=True)
    queue = Queue(f"{name}.all", exchange, routing_key="#", durable=True)
    first, second = str(uuid.uuid4()), str(uuid.uuid4())
    with Connection(RABBITMQ) as connection:
        queue(connection.default_channel).declare()
        producer = connection.Producer()
        for message_id in (first, second, first):  # a redelivery of the first
            envelope = {
                "specversion": "1.0",
                "id": message_id,
                "source": "sample-shop",
                "type": "OrderPlaced",
                "data": {
                    "order_id": 1,
                    "customer_email": "a@example.com",
                    "total": "1",
                },
            }
            producer.publish(
                json.dumps(envelope),
                exchange=exchange,
                routing_key="shop.order.OrderPlaced",
                message_id=message_id,
                content_type="application/cloudevents+json",
            )
        try:
            result = _manage(env, "consume", "--idle-exit", "2")
        finally:
            queue(connection.default_channel).delete()
            exchange(connection.default_channel).delete()
    assert "handled 2, duplicates 1" in result.stdout, result.stderr


def _count(env: dict, expression: str) -> int:
    """An integer the shop's database answers (``manage.py shell -c``)."""
    code = f"from outbox_app import OutboxEvent; print({expression})"
    return int(_manage(env, "shell", "-c", code).stdout.strip().splitlines()[-1])


@pytest.mark.services("rabbitmq")
def test_a_second_project_consumes_the_shop_s_events_once(shop_env, tmp_path):
    """The billing service (sample_consumer, its own project and database)
    consumes the shop's events through manage.py consume while the shop
    simulates orders; it is SIGKILLed mid-stream and restarted, and the shop
    then publishes every event a second time: one invoice per OrderPlaced, one
    payment per OrderPaid, the duplicates acknowledged without effect."""
    require_service("rabbitmq")
    import sqlite3

    from kombu import Connection, Exchange, Queue

    exchange = f"shop.events.billing{uuid.uuid4().hex[:8]}"
    queue = f"billing.orders.{exchange}"  # the suites on other databases have theirs
    shop = {**shop_env, "OUTBOX_BROKER_URL": RABBITMQ, "SHOP_EVENTS_EXCHANGE": exchange}
    database = tmp_path / "billing.sqlite3"
    billing = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sample_consumer.settings",
        "BILLING_DATABASE_URL": f"sqlite:///{database}",
        "OUTBOX_BROKER_URL": RABBITMQ,
        "SHOP_EVENTS_EXCHANGE": exchange,
        "BILLING_QUEUE": queue,
    }
    django = [sys.executable, "-m", "django"]
    subprocess.run([*django, "migrate", "-v0"], cwd=ROOT, env=billing, check=True)

    def wait(predicate, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not predicate():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)

    def consume() -> Watched:
        process = Watched(
            subprocess.Popen(
                [*django, "consume"],
                cwd=ROOT,
                env=billing,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
        wait(lambda: process.has("consume ready"), 30)  # its queue is bound
        return process

    def billed(column: str = "COUNT(*)") -> int:
        with sqlite3.connect(database) as db:
            return (
                db.execute(f"SELECT {column} FROM billing_invoice").fetchone()[0] or 0
            )

    first = consume()
    second = None
    simulation = subprocess.Popen(
        [sys.executable, "manage.py", "simulate", "--orders", "60"],
        cwd=ROOT,
        env=shop,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        wait(lambda: billed() >= 10)
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL  # mid-stream
        second = consume()
        # (Its own reconciliation is test_simulate_reconciles': this module's
        # database also holds the other tests' rows.)
        report = simulation.communicate(timeout=120)[0]
        assert "all delivered" in report, report
        # The shop's relay publishes every event a second time.
        _manage(
            shop,
            "shell",
            "-c",
            "from outbox_app import OutboxEvent; "
            "from outbox_app.ops.subscriptions import replay_to; "
            "replay_to(OutboxEvent.objects.exclude(event_type=None), 'broker')",
        )
        _manage(shop, "relay", "--once")
        placed = _count(
            shop, "OutboxEvent.objects.filter(event_type='OrderPlaced').count()"
        )
        paid = _count(
            shop, "OutboxEvent.objects.filter(event_type='OrderPaid').count()"
        )
        # Every event of the module's database, replayed: minutes on a loaded
        # machine, not a measure of anything.
        wait(lambda: billed() == placed and billed("SUM(payments)") == paid, 240)
        code = second.stop()
        # What the stopped consumer had not read yet (duplicates write
        # nothing, so their end cannot be watched): drained by a last one.
        last = subprocess.run(
            [*django, "consume", "--idle-exit", "3"],
            cwd=ROOT,
            env=billing,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        if simulation.poll() is None:
            simulation.kill()
            simulation.communicate()
        first.stop(signal.SIGKILL)
        if second is not None:
            second.stop()
        with Connection(RABBITMQ) as connection:
            channel = connection.default_channel
            for name in (queue, f"{exchange}.all"):
                Queue(name, Exchange(exchange))(channel).delete()
            Exchange(exchange)(channel).delete()
    log = second.text() + last.stderr
    assert code == 0 and last.returncode == 0, log
    assert (billed(), billed("SUM(payments)")) == (placed, paid)
    assert billed("MAX(payments)") <= 1
    # The replay alone brought every OrderPlaced and OrderPaid again.
    tallies = re.findall(r"consume stopped: handled (\d+), duplicates (\d+)", log)
    assert len(tallies) == 2, log
    handled, duplicates = (sum(int(t[i]) for t in tallies) for i in (0, 1))
    assert handled + duplicates >= placed + paid, log
    assert duplicates > 0, log
    with sqlite3.connect(database) as db:
        states = dict(
            db.execute(
                "SELECT state, COUNT(*) FROM outbox_app_inboxmessage GROUP BY state"
            ).fetchall()
        )
    assert set(states) == {"HANDLED"}, states


@pytest.mark.services("rabbitmq")
def test_a_corewrite_subscriber_indexes_the_catalog(shop_env, tmp_path):
    """sample_consumer/search_indexer.py reads the shop's catalog (Listing's
    change events, FORMAT corewrite, on a fanout exchange) as a CoreWrite
    subscriber does; the shop's relay is run twice over the same events (a
    replay), and the index ends as the catalog is, each change applied once."""
    require_service("rabbitmq")
    from kombu import Connection, Exchange, Queue

    exchange = f"shop.catalog.{uuid.uuid4().hex[:8]}"
    queue = f"search-indexer.{exchange}"
    shop = {
        **shop_env,
        "OUTBOX_BROKER_URL": RABBITMQ,
        "SHOP_CATALOG_EXCHANGE": exchange,
    }
    index = tmp_path / "search-index.json"
    indexer = Watched(
        subprocess.Popen(
            [sys.executable, "-m", "sample_consumer.search_indexer"],
            cwd=ROOT,
            env={
                **os.environ,
                "OUTBOX_BROKER_URL": RABBITMQ,
                "SHOP_CATALOG_EXCHANGE": exchange,
                "SEARCH_QUEUE": queue,
                "SEARCH_INDEX": str(index),
            },
            stdout=subprocess.PIPE,  # unused: it logs to stderr
            stderr=subprocess.PIPE,
            text=True,
        )
    )

    def documents() -> dict:
        return json.loads(index.read_text())["documents"] if index.exists() else {}

    def wait(predicate, seconds: float = 60) -> None:
        deadline = time.monotonic() + seconds
        while not predicate():
            assert indexer.process.poll() is None, indexer.text()
            assert time.monotonic() < deadline, indexer.text()
            time.sleep(0.1)

    try:
        wait(lambda: indexer.has("Waiting for events"), 30)  # its queue is bound
        writes = (
            "from django.utils import timezone\n"
            "from outbox_app import acting\n"
            "from sample_project.shop.models import Listing\n"
            "with acting('ana@example.com', source='catalogManagement'):\n"
            "    tea = Listing.objects.create(title='Sencha', price='4.50')\n"
            "    cup = Listing.objects.create(title='Cup', price='9.00')\n"
            "    gone = Listing.objects.create(title='Old', price='1.00')\n"
            "    tea.price = '3.90'; tea.save()\n"
            "    cup.withdrawn_at = timezone.now(); cup.save()\n"
            "    gone.delete()\n"
            "print(tea.pk)"
        )
        tea = _manage(shop, "shell", "-c", writes).stdout.split()[-1]
        _manage(shop, "relay", "--once")
        wait(lambda: list(documents()) == [tea])
        document = documents()[tea]
        assert document["title"] == "Sencha" and document["price"] == "3.90"
        assert document["id"] == int(tea)
        # Every catalog event once more: the index skips what it applied.
        _manage(
            shop,
            "shell",
            "-c",
            "from outbox_app import OutboxEvent; "
            "from outbox_app.ops.subscriptions import replay_to; "
            "replay_to(OutboxEvent.objects.filter(event_type__startswith='Listing'), "
            "'catalog')",
        )
        _manage(shop, "relay", "--once")
        wait(lambda: indexer.text().count("Skipped a redelivery") >= 6)
    finally:
        code = indexer.stop()
        with Connection(RABBITMQ) as connection:
            channel = connection.default_channel
            Queue(queue, Exchange(exchange, "fanout"))(channel).delete()
            Exchange(exchange, "fanout")(channel).delete()
    log = indexer.text()
    assert code == 0, log
    assert list(documents()) == [tea]
    assert "Indexed listing: " in log and "Removed listing from index: " in log
    assert "(by ana@example.com)" in log
