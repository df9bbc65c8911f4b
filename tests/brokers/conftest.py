"""Fixtures for the broker tests: real RabbitMQ, Redis, NATS JetStream and a
Kafka-protocol broker (tansu, started here), no mocks.

Each test gets uniquely named exchanges, queues and streams and deletes them
afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Exchange, Queue

from outbox_app.subscribers import DeliveryContext
from tests.conftest import require_service
from tests.services import NATS_URL, RABBITMQ_URL, REDIS_URL, address

from .proxy import TcpProxy
from .tansu import Tansu

#: Where the brokers listen (their URLs: tests/services.py, from the environment).
RABBITMQ = address(RABBITMQ_URL)
NATS = address(NATS_URL)
#: A queue nobody deletes (a crashed test run) disappears after 10 minutes unused.
QUEUE_ARGUMENTS = {"x-expires": 600_000}


@pytest.fixture
def rabbitmq_url() -> str:
    require_service("rabbitmq")
    return RABBITMQ_URL


@pytest.fixture
def redis_url() -> str:
    require_service("redis")
    return REDIS_URL


@pytest.fixture
def nats_url() -> str:
    require_service("nats")
    return NATS_URL


@pytest.fixture(scope="session")
def _session_tansu() -> Iterator[Tansu]:
    require_service("kafka")
    with Tansu() as broker:
        yield broker


@pytest.fixture
def kafka_servers(_session_tansu) -> str:
    """The ``BOOTSTRAP_SERVERS`` of a tansu broker this test session started
    on a free port (shared by the session's tests: each uses topics of its
    own)."""
    return _session_tansu.servers


@pytest.fixture
def tansu(kafka_servers) -> Iterator[Tansu]:
    """A tansu broker of this test's own, started, which it may stop and
    start again (on the same port)."""
    with Tansu() as broker:
        yield broker


@pytest.fixture
def unique() -> str:
    """A name prefix no other test (or test run) uses."""
    return f"outbox-test-{uuid.uuid4().hex[:12]}"


class Broker:
    """An independent kombu consumer side: declares queues, reads them back,
    and deletes everything it declared (and the exchanges it was told about)."""

    def __init__(self, url: str):
        self.url = url
        self.connection = Connection(url)
        self.channel = self.connection.channel()
        self.queues: list[str] = []  # names to delete afterwards
        self.exchanges: list[str] = []

    def bind(
        self,
        queue: str,
        exchange: str,
        routing_key: str = "#",
        exchange_type: str = "topic",
        arguments: dict[str, Any] | None = None,
        expires: bool = True,
    ) -> Queue:
        declared = Queue(
            queue,
            self.exchange(exchange, exchange_type),
            routing_key=routing_key,
            durable=True,
            queue_arguments={
                **(QUEUE_ARGUMENTS if expires else {}),
                **(arguments or {}),
            }
            if self.amqp
            else None,
        )(self.channel)
        self.queues.append(queue)
        declared.declare()
        return declared

    def exchange(self, name: str, exchange_type: str = "topic") -> Exchange:
        self.exchanges.append(name)
        return Exchange(name, exchange_type, durable=True)(self.channel)

    def drain(self, queue: Queue) -> list:
        """Every message waiting in ``queue``, in queue order."""
        messages = []
        while (message := queue.get(no_ack=True)) is not None:
            messages.append(message)
        return messages

    @property
    def amqp(self) -> bool:
        return self.url.startswith("amqp")

    def delete_later(self, queue: str) -> None:
        """Delete ``queue`` (declared by someone else) after the test."""
        self.queues.append(queue)

    def cleanup(self) -> None:
        for delete, names in (
            ("queue_delete", self.queues),
            ("exchange_delete", self.exchanges),
        ):
            for name in dict.fromkeys(names):
                try:
                    getattr(self.channel, delete)(name)
                except Exception:
                    self.channel = self.connection.channel()  # the broker closed it
        self.connection.release()


@pytest.fixture
def rabbitmq(rabbitmq_url) -> Iterator[Broker]:
    broker = Broker(rabbitmq_url)
    yield broker
    broker.cleanup()


@pytest.fixture
def redis(redis_url) -> Iterator[Broker]:
    broker = Broker(redis_url)
    yield broker
    broker.cleanup()


@pytest.fixture
def proxy(rabbitmq_url) -> Iterator[TcpProxy]:
    """A cuttable loopback proxy in front of RabbitMQ."""
    tcp = TcpProxy(RABBITMQ)
    yield tcp
    tcp.close()


@pytest.fixture
def nats_proxy(nats_url) -> Iterator[TcpProxy]:
    """A cuttable loopback proxy in front of NATS."""
    tcp = TcpProxy(NATS)
    yield tcp
    tcp.close()


class JetStream:
    """An independent nats-py client: creates streams, reads them back, and
    deletes every stream it created or was told about."""

    def __init__(self, url: str):
        self.url = url
        self.streams: list[str] = []

    def run(self, work) -> Any:
        """``await work(js)`` on a connection of its own (a JetStreamContext)."""

        async def session():
            import nats

            client = await nats.connect(self.url)
            try:
                return await work(client.jetstream())
            finally:
                await client.close()

        return asyncio.run(session())

    def create(self, name: str, subjects: list[str], **config: Any) -> None:
        self.streams.append(name)
        self.run(lambda js: js.add_stream(name=name, subjects=subjects, **config))

    def info(self, name: str) -> Any:
        return self.run(lambda js: js.stream_info(name))

    def messages(self, name: str) -> list:
        """Every message stored in stream ``name``, in stream order."""

        async def read(js):
            state = (await js.stream_info(name)).state
            if not state.messages:
                return []
            return [
                await js.get_msg(name, seq)
                for seq in range(state.first_seq, state.last_seq + 1)
            ]

        return self.run(read)

    def delete_later(self, name: str) -> None:
        self.streams.append(name)

    def cleanup(self) -> None:
        for name in dict.fromkeys(self.streams):
            # A stream never created (a test of a missing one) raises.
            with contextlib.suppress(Exception):
                self.run(lambda js, name=name: js.delete_stream(name))


@pytest.fixture
def jetstream(nats_url) -> Iterator[JetStream]:
    client = JetStream(nats_url)
    yield client
    client.cleanup()


@pytest.fixture
def publishers() -> Iterator[list]:
    """Publishers a test builds; closed afterwards."""
    built: list = []
    yield built
    for publisher in built:
        publisher.close()


def context(
    number: int,
    aggregate_type: str | None = "shop.Order",
    aggregate_id: str | None = "1",
    event_type: str = "OrderPlaced",
    **fields: Any,
) -> DeliveryContext:
    """A DeliveryContext as the relay builds it, numbered for assertions."""
    values: dict[str, Any] = {
        "event_id": uuid.uuid4(),
        "namespace": "shop",
        "event_type": event_type,
        "revision": 1,
        "payload": {"number": number, "text": "grüße"},
        "aggregate_type": aggregate_type,
        "aggregate_id": aggregate_id,
        "aggregate_version": number,
        "headers": {"correlation_id": f"req-{number}"},
        "tenant_id": "acme",
        "action_id": None,
        "occurred_at": datetime.datetime(
            2025, 6, 1, 12, 0, number % 60, 1000, datetime.UTC
        ),
        "attempt": 1,
        "subscriber": "broker",
        "delivery_id": number,
    }
    values.update(fields)
    return DeliveryContext(**values)


def across_aggregates(count: int) -> list[DeliveryContext]:
    """``count`` events over three orders and two customers, interleaved."""
    aggregates = [
        ("shop.Order", "1"),
        ("shop.Order", "2"),
        ("shop.Customer", "7"),
        ("shop.Order", "3"),
        ("shop.Customer", "8"),
    ]
    result = []
    for number in range(count):
        aggregate_type, aggregate_id = aggregates[number % len(aggregates)]
        event_type = (
            "OrderPlaced" if aggregate_type == "shop.Order" else "CustomerMoved"
        )
        result.append(context(number, aggregate_type, aggregate_id, event_type))
    return result


def body(message) -> dict[str, Any]:
    """The CloudEvent a consumer received."""
    return json.loads(message.body)


def assert_delivered(message, sent: DeliveryContext, routing_key: str) -> None:
    """``message`` is ``sent``'s CloudEvent with the right AMQP/kombu properties."""
    event = body(message)
    assert event["id"] == str(sent.event_id)
    assert event["specversion"] == "1.0"
    assert event["source"] == sent.namespace
    assert event["type"] == sent.event_type
    assert event["subject"] == sent.aggregate_id
    assert event["aggregatetype"] == sent.aggregate_type
    assert event["aggregateversion"] == sent.aggregate_version
    assert event["revision"] == sent.revision
    assert event["tenantid"] == sent.tenant_id
    assert event["correlationid"] == sent.headers["correlation_id"]
    assert event["time"].endswith("Z")
    assert event["datacontenttype"] == "application/json"
    assert event["data"] == sent.payload
    assert message.content_type == "application/cloudevents+json"
    assert message.properties["message_id"] == str(sent.event_id)
    assert message.delivery_info["routing_key"] == routing_key
