"""The transactional inbox end to end: the relay publishes to real RabbitMQ and
Redis, ``manage.py consume`` processes consume, on every database."""

from __future__ import annotations

import decimal
import json
import logging
import re
import signal
import socket
import time

import pytest
from django.db import transaction
from kombu import Producer

from outbox_app import InboxMessage, OutboxEvent, publish
from outbox_app.inbox.worker import RETRY_EVERY
from outbox_app.ops.subscriptions import replay_to
from outbox_app.publishers import cloudevents
from outbox_app.relay import relay_once
from outbox_app.store.lifecycle import InboxState
from tests.brokers.conftest import RABBITMQ, context
from tests.brokers.proxy import TcpProxy
from tests.kit import free_port, scrape
from tests.processes import (
    Watched,
    kill_other_connections,
    loopback_only,
    spawn,
    wait_for,
)
from tests.services import RABBITMQ_URL, through
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("_close_publishers"),
]


def consume(
    broker,
    exchange: str,
    queue: str,
    *args: str,
    url: str | None = None,
    ready: bool = True,
    **env: str,
) -> Watched:
    """``manage.py consume ARGS`` of ``tests/testapp/consumers.py``'s consumers
    on ``queue``, bound to ``exchange``, reading from ``url`` (default the
    broker's); returned once it is ready (unless ``ready`` is false)."""
    broker.delete_later(queue)
    process = Watched(
        spawn(
            "manage.py",
            "consume",
            "--settings=tests.settings",
            *args,
            OUTBOX_TEST_INBOX_URL=url or broker.url,
            OUTBOX_TEST_INBOX_EXCHANGE=exchange,
            OUTBOX_TEST_CONSUMER_QUEUE=queue,
            **env,
        )
    )
    if ready:
        wait_for(lambda: process.has("consume ready"), 30, "consume to be ready")
    return process


def publish_through(settings, broker, exchange: str, orders: range) -> list:
    """Commit OrderPlaced events and relay them to ``exchange``."""
    broker.exchange(exchange)  # deleted afterwards
    settings.OUTBOX_PUBLISHERS = {"bus": {"URL": broker.url, "EXCHANGE": exchange}}
    with transaction.atomic():
        rows = publish(
            *[OrderPlaced(order_id=n, total=decimal.Decimal(n)) for n in orders]
        )
    assert relay_once(kind="publisher").succeeded == len(rows)
    return rows


def send(
    broker,
    exchange: str,
    order_id: int,
    event_type: str = "OrderPlaced",
    **attributes,
) -> str:
    """Publish one OrderPlaced (or ``event_type``) as the relay would,
    straight to ``exchange`` (no database write in this process: on SQLite a
    consumer inside its transaction holds the only write lock), its CloudEvents
    ``attributes`` replaced (JSON of Python's encoder, as a foreign producer
    may write). Returns its message id."""
    message = context(
        order_id, event_type=event_type, payload={"order_id": order_id, "total": "1.00"}
    )
    body = cloudevents.body(message)
    if attributes:
        body = json.dumps({**json.loads(body), **attributes}).encode()
    producer = Producer(broker.channel, exchange=broker.exchange(exchange))
    producer.publish(
        body,
        routing_key="shop.Order.OrderPlaced",
        content_type=cloudevents.CONTENT_TYPE,
        message_id=str(message.event_id),
        delivery_mode=2,
    )
    return str(message.event_id)


def effects(handler: str = "tests.inbox") -> int:
    return SideEffect.objects.filter(handler=handler).count()


def positions(handler: str) -> list[int]:
    return sorted(
        SideEffect.objects.filter(handler=handler).values_list("position", flat=True)
    )


def after_one_more_retry_pass() -> None:
    """Wait until consume has looked for due retries once more (it looks every
    ``RETRY_EVERY`` seconds), so a message run again after it was finished
    shows in the counts read next."""
    time.sleep(RETRY_EVERY + 0.5)


def stopped(process: Watched) -> dict[str, int]:
    """The counts of ``consume``'s last line, "consume stopped: handled 3, ..."."""
    line = re.search(r"consume stopped: (.*)", process.text())
    assert line, process.text()
    return {
        name: int(count)
        for name, count in (field.rsplit(" ", 1) for field in line[1].split(", "))
    }


@pytest.mark.parametrize(
    "broker_name",
    # On every database through RabbitMQ; Redis, another transport under the
    # same inbox, once (the SQLite pass).
    ["rabbitmq", pytest.param("redis", marks=pytest.mark.any_database)],
)
def test_duplicates_have_no_effect_and_a_poison_message_is_dead(
    request, broker_name, settings, unique
):
    broker = request.getfixturevalue(broker_name)
    # It exits once nothing arrived and no retry ran for 5 s: after the
    # duplicates too (waiting for their effects cannot tell: they have none).
    consumer = consume(
        broker,
        unique,
        f"{unique}-in",
        "--idle-exit",
        "5",
        OUTBOX_TEST_CONSUMER_POISON="13",
        OUTBOX_TEST_RETRY_BASE="0.05",
        OUTBOX_TEST_RETRY_MAX="0.1",
    )
    try:
        rows = publish_through(settings, broker, unique, range(20))
        # The relay publishes every event a second time (a replay; a relay
        # killed between the broker's confirm and its mark does the same).
        replay_to(OutboxEvent.objects.filter(id__in=[r.id for r in rows]), "bus")
        assert relay_once(kind="publisher").succeeded == 20
        consumer.process.wait(60)
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    assert effects() == 19
    parked = InboxMessage.objects.get(state=InboxState.DEAD)
    assert (parked.attempts, parked.last_error) == (2, "order 13 is poison")
    assert InboxMessage.objects.filter(state=InboxState.HANDLED).count() == 19
    stopped = re.search(
        r"consume stopped: handled (\d+), duplicates (\d+)", consumer.text()
    )
    assert stopped and stopped.groups() == ("19", "20"), consumer.text()


def test_a_consumer_killed_mid_message_runs_it_once_after_a_restart(
    rabbitmq, settings, unique, tmp_path
):
    """SIGKILL while the consumer's transaction is open: nothing committed, the
    message was not acknowledged, so RabbitMQ delivers it again to the next
    process, which runs it once."""
    queue, hang = f"{unique}-in", tmp_path / "inside"
    first = consume(rabbitmq, unique, queue, OUTBOX_TEST_CONSUMER_HANG=str(hang))
    try:
        message_id = send(rabbitmq, unique, 1)
        wait_for(hang.exists, 30, "the consumer to be inside its transaction")
    finally:
        assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    assert effects() == 0 and not InboxMessage.objects.exists()
    second = consume(rabbitmq, unique, queue)
    try:
        wait_for(lambda: effects() == 1, 30, "the redelivered message's effect")
    finally:
        assert second.stop() == 0
    handled = InboxMessage.objects.get()
    assert (handled.message_id, handled.state) == (message_id, InboxState.HANDLED)
    assert effects() == 1


def test_sigterm_finishes_the_message_in_hand(rabbitmq, settings, unique, tmp_path):
    hang = tmp_path / "inside"
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        OUTBOX_TEST_CONSUMER_HANG=str(hang),
        OUTBOX_TEST_CONSUMER_HANG_SECONDS="2",
    )
    try:
        send(rabbitmq, unique, 1)
        wait_for(hang.exists, 30, "the consumer to be inside its transaction")
    finally:
        code = consumer.stop()  # SIGTERM while the consumer sleeps
    assert code == 0, consumer.text()
    assert effects() == 1
    assert InboxMessage.objects.get().state == InboxState.HANDLED


@pytest.mark.any_database  # the broker's redelivery; duplicates on each: above
def test_a_connection_lost_between_commit_and_ack__the_redelivery_has_no_effect(
    rabbitmq, proxy, unique, tmp_path
):
    """The broker connection drops while a consumer's transaction is open:
    the transaction commits, the ack cannot be sent, consume reconnects, and
    RabbitMQ delivers the message again: a duplicate, acknowledged without
    running the consumer. Messages sent while the consumer was cut off are
    consumed once it is back."""
    hang = tmp_path / "inside"
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        "--idle-exit",
        "4",
        url=through(RABBITMQ_URL, proxy.port),
        OUTBOX_TEST_CONSUMER_HANG=str(hang),
        OUTBOX_TEST_CONSUMER_HANG_SECONDS="2",
    )
    try:
        first = send(rabbitmq, unique, 1)
        wait_for(hang.exists, 30, "the consumer to be inside its transaction")
        proxy.cut()  # the consumer commits in 2 s; its ack has nowhere to go
        later = [send(rabbitmq, unique, n) for n in (2, 3)]
        wait_for(lambda: consumer.has("broker unreachable"), 30, "the lost ack")
        proxy.restore()
        consumer.process.wait(90)  # --idle-exit: after the redelivery
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    handled = InboxMessage.objects.filter(state=InboxState.HANDLED)
    assert sorted(handled.values_list("message_id", flat=True)) == sorted(
        [first, *later]
    )
    assert effects() == 3
    stopped = re.search(
        r"consume stopped: handled (\d+), duplicates (\d+)", consumer.text()
    )
    assert stopped and stopped.groups() == ("3", "1"), consumer.text()


@pytest.mark.only_database("postgresql", "mysql")  # SQLite has no sessions to end
def test_a_database_connection_lost_mid_batch__messages_handed_back_and_run_once(
    rabbitmq, unique, tmp_path
):
    """The consumer's database session ends while its transaction is open (a
    database restart, a network cut): the COMMIT fails, the messages go back
    to the broker unacknowledged, consume waits and reconnects, and runs them
    once."""
    hang = tmp_path / "inside"
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        OUTBOX_TEST_CONSUMER_HANG=str(hang),
        OUTBOX_TEST_CONSUMER_HANG_SECONDS="1",
    )
    try:
        message_id = send(rabbitmq, unique, 1)
        wait_for(hang.exists, 30, "the consumer to be inside its transaction")
        assert kill_other_connections() >= 1
        wait_for(lambda: effects() == 1, 60, "the message run again, committed")
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    assert consumer.has("consume: database error"), consumer.text()
    handled = InboxMessage.objects.get()
    assert (handled.message_id, handled.state) == (message_id, InboxState.HANDLED)


def test_a_raising_on_commit_callback_fails_its_message_and_consume_goes_on(
    rabbitmq, unique
):
    """Order 3's callback raises on its first attempt: its message is FAILED
    (the consumer's write committed), retried from the database (the
    consumer runs again: idempotent), and handled; every other callback ran,
    and the process keeps running."""
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        OUTBOX_TEST_CONSUMER_CALLBACK_FAILS="3",
        OUTBOX_TEST_RETRY_BASE="0.05",
        OUTBOX_TEST_RETRY_MAX="0.1",
    )
    try:
        ids = [send(rabbitmq, unique, n) for n in range(6)]
        handled = InboxMessage.objects.filter(state=InboxState.HANDLED)
        wait_for(
            lambda: handled.count() == 6 and len(positions("tests.inbox.after")) == 6,
            60,
            "every message handled and its callback run",
        )
        after_one_more_retry_pass()
        assert consumer.process.poll() is None, consumer.text()
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    assert positions("tests.inbox") == list(range(6))
    assert positions("tests.inbox.after") == list(range(6))
    third = InboxMessage.objects.get(message_id=ids[3])
    assert (third.state, third.attempts) == (InboxState.HANDLED, 2)
    assert third.last_error == "the callback of order 3 failed"  # history
    assert stopped(consumer)["handled"] == 6, consumer.text()


def test_poison_input_through_consume_is_dead_readably_and_the_rest_handled(
    rabbitmq, unique
):
    """A consumer raising text no column can hold (a lone surrogate, NUL),
    and a CloudEvent whose subject holds NUL: both DEAD with readable
    text, the other messages handled, consume never stops."""
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        OUTBOX_TEST_CONSUMER_GARBLED="2",
        OUTBOX_TEST_RETRY_BASE="0.05",
        OUTBOX_TEST_RETRY_MAX="0.1",
    )
    try:
        for n in range(5):
            send(rabbitmq, unique, n)
        poison = send(rabbitmq, unique, 9, subject="4\x002")
        send(rabbitmq, unique, 5)
        finished = InboxMessage.objects.filter(
            state__in=[InboxState.HANDLED, InboxState.DEAD]
        )
        wait_for(lambda: finished.count() == 7, 60, "each message handled or dead")
        after_one_more_retry_pass()
        assert consumer.process.poll() is None, consumer.text()
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    assert positions("tests.inbox") == [0, 1, 3, 4, 5]
    garbled = InboxMessage.objects.get(last_error_type="builtins.ValueError")
    assert (garbled.state, garbled.attempts) == (InboxState.DEAD, 2)
    assert garbled.last_error == "order 2 is \\udcff\\x00 garbled"
    undecodable = InboxMessage.objects.get(message_id=poison)
    assert undecodable.state == InboxState.DEAD
    assert "subject holds a NUL character" in undecodable.last_error


def test_metrics_port_serves_the_consumers_counters(rabbitmq, unique):
    """``consume --metrics-port``: messages received per queue, by outcome
    (a redelivered one a duplicate) and by error class per consumer, the
    consumer calls' durations and the handled messages' latency, read from
    the running process, which listens on 127.0.0.1 only."""
    port = free_port()
    consumer = consume(
        rabbitmq,
        unique,
        f"{unique}-in",
        "--metrics-port",
        str(port),
        OUTBOX_TEST_CONSUMER_POISON="3",
        OUTBOX_TEST_RETRY_BASE="0.05",
        OUTBOX_TEST_RETRY_MAX="0.1",
    )
    snapshot: dict = {}

    def outcome(word: str) -> tuple:
        labels = (("consumer", "tests.inbox"), ("outcome", word))
        return ("outbox_consume_outcomes_total", labels)

    def counted() -> bool:
        snapshot.clear()
        snapshot.update(scrape(port))
        return (
            snapshot.get(outcome("dead")) == 1
            and snapshot.get(outcome("handled")) == 4
            and snapshot.get(outcome("duplicate")) == 1
        )

    try:
        # No --metrics-host: this machine only (the server checks no credentials).
        assert loopback_only(port)
        ids = [send(rabbitmq, unique, n) for n in range(5)]
        send(rabbitmq, unique, 0, id=ids[0])  # the broker delivers it twice
        wait_for(counted, 60, "the outcomes counted")
    finally:
        code = consumer.stop()
    assert code == 0, consumer.text()
    # 3 is poison: failed once, then DEAD on its second (last) attempt.
    assert snapshot[outcome("handled")] == 4
    assert snapshot[outcome("failed")] == 1
    error = (("consumer", "tests.inbox"), ("error", "builtins.ValueError"))
    assert snapshot[("outbox_consume_failures_total", error)] == 2
    calls = ("outbox_consume_consumer_seconds_count", (("consumer", "tests.inbox"),))
    assert snapshot[calls] >= 6  # each call, failed or not
    received = ("outbox_consume_received_total", (("queue", f"{unique}-in"),))
    assert snapshot[received] == 6  # the retries come from the database
    # Handled messages only: not the failed or dead attempts, not the duplicate.
    latency = ("outbox_consume_latency_seconds_count", (("consumer", "tests.inbox"),))
    assert snapshot[latency] == 4


def test_a_rolling_deploy_keeps_the_messages_of_a_consumer_only_new_code_has(
    rabbitmq, unique
):
    """``tests.audit`` exists in the new code only. A process of the old
    code never acknowledges its messages as ignored: they are kept as its
    inbox rows (FAILED, due) until a process of the new code runs them, and
    the old code's own consumer runs as before; then both run side by side."""
    queue = f"{unique}-in"
    both = {"OUTBOX_TEST_CONSUMERS": "tests.inbox,tests.audit"}
    new = consume(rabbitmq, unique, queue, **both)  # records its consumers
    assert new.stop() == 0, new.text()
    old = consume(rabbitmq, unique, queue)
    try:
        for n in range(100):
            send(rabbitmq, unique, n)
            send(rabbitmq, unique, 1000 + n, event_type="ParcelSent")
        wait_for(lambda: effects() == 100, 60, "the old code's consumer")
        kept = InboxMessage.objects.filter(consumer="tests.audit")
        wait_for(lambda: kept.count() == 200, 30, "tests.audit's messages kept")
        assert effects("tests.audit") == 0
        waiting = kept.first()
        assert (waiting.state, waiting.attempts) == (InboxState.FAILED, 0)
        assert "tests.audit" in waiting.last_error and waiting.body
        new = consume(rabbitmq, unique, queue, **both)
        try:
            for n in range(100, 200):
                send(rabbitmq, unique, n)
                send(rabbitmq, unique, 1000 + n, event_type="ParcelSent")
            wait_for(
                lambda: effects("tests.audit") == 400 and effects() == 200,
                90,
                "every message run once by each consumer",
            )
        finally:
            assert new.stop() == 0, new.text()
    finally:
        assert old.stop() == 0, old.text()
    assert positions("tests.audit") == sorted([*range(200), *range(1000, 1200)])
    assert positions("tests.inbox") == list(range(200))
    assert stopped(old)["ignored"] == 0, old.text()
    assert not InboxMessage.objects.exclude(state=InboxState.HANDLED).exists()


@pytest.mark.any_database  # the broker connection's backoff
def test_consume_started_while_the_broker_refuses_connections_waits_for_it(
    rabbitmq, unique
):
    """Started against a closed port: one log line per attempt, backing off,
    until the broker is there (a proxy opened on that port later); then it
    consumes what was published meanwhile."""
    queue = f"{unique}-in"
    rabbitmq.bind(queue, unique, expires=False)  # the messages wait in it
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    consumer = consume(
        rabbitmq,
        unique,
        queue,
        url=through(RABBITMQ_URL, port),
        ready=False,
    )
    proxy = None
    try:
        for n in range(3):
            send(rabbitmq, unique, n)
        wait_for(
            lambda: len(re.findall("broker unreachable", consumer.text())) >= 3,
            30,
            "three attempts to connect",
        )
        assert consumer.process.poll() is None, consumer.text()
        proxy = TcpProxy(RABBITMQ, port=port)
        wait_for(lambda: effects() == 3, 60, "the messages published meanwhile")
    finally:
        code = consumer.stop()
        if proxy is not None:
            proxy.close()
    assert code == 0, consumer.text()
    delays = [
        float(d) for d in re.findall(r"reconnecting in ([\d.]+) s", consumer.text())
    ]
    assert delays[:3] == [0.5, 1.0, 2.0], consumer.text()


def test_consume_health_file__not_ready_while_the_broker_refuses_then_ready(
    rabbitmq, unique, tmp_path
):
    """``consume --health-file``: alive and not ready (broker unreachable)
    against a closed port, ready once the broker is there; removed on stop."""
    from tests.relay.test_health import probe

    queue = f"{unique}-in"
    rabbitmq.bind(queue, unique, expires=False)
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]
    path = tmp_path / "consume.health"
    consumer = consume(
        rabbitmq,
        unique,
        queue,
        "--health-file",
        str(path),
        url=through(RABBITMQ_URL, port),
        ready=False,
    )
    proxy = None
    try:
        wait_for(path.exists, 30, "the first attempt to connect")
        code, err = probe(path, "--ready", "--max-age", "2")
        assert code == 1 and "not ready: broker unreachable:" in err, err
        # Alive through the backoff's waits (0.5, 1, 2, 4 s: past --max-age).
        time.sleep(4)
        assert probe(path, "--max-age", "2") == (0, ""), consumer.text()
        proxy = TcpProxy(RABBITMQ, port=port)
        wait_for(
            lambda: probe(path, "--ready", "--max-age", "2")[0] == 0,
            30,
            "consume ready",
        )
    finally:
        code = consumer.stop()
        if proxy is not None:
            proxy.close()
    assert code == 0, consumer.text()
    assert not path.exists()


def test_consume_logs_each_batch_at_debug(rabbitmq, settings, unique, caplog):
    """``consume -v 2`` tells what each batch did, as the relay tells each
    iteration: ``consume batch messages=N handled=...``."""
    from outbox_app.inbox.registry import consumer as register
    from outbox_app.inbox.registry import consumers, unregister_consumer
    from outbox_app.inbox.worker import ConsumeWorker

    queue = f"{unique}-in"
    rabbitmq.bind(queue, unique, expires=False)
    rabbitmq.delete_later(queue)
    settings.OUTBOX_INBOX_EXCHANGE = unique
    register(OrderPlaced, queue=queue, name=unique)(lambda event, context: None)
    try:
        for n in range(3):
            send(rabbitmq, unique, n)
        caplog.set_level(logging.DEBUG, logger="outbox_app.inbox")
        tally = ConsumeWorker(consumers([queue]), url=rabbitmq.url, idle_exit=1).run()
    finally:
        unregister_consumer(unique)
    assert tally.handled == 3
    batches = re.findall(
        r"consume batch messages=(\d+) handled=(\d+) duplicates=0", caplog.text
    )
    assert batches, caplog.text
    assert sum(int(m) for m, _ in batches) == 3
    assert sum(int(h) for _, h in batches) == 3
