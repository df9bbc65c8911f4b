"""End to end: committed events leave the database through the relay and reach
real RabbitMQ and Redis, read back by an independent kombu consumer."""

from __future__ import annotations

import datetime
import decimal
import json
import signal
import time
import urllib.parse
from collections import defaultdict

import pytest
from django.db import transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, publish
from outbox_app.models import SubscriberPause
from outbox_app.relay import deliver, relay_once
from outbox_app.store.lifecycle import State
from tests import kit
from tests.brokers.conftest import body
from tests.processes import publisher_relay, wait_for
from tests.services import RABBITMQ_URL, through
from tests.testapp.events import OrderPlaced, Step

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.usefixtures("_close_publishers"),
]

AGGREGATES = [("shop.Order", "1"), ("shop.Order", "2"), ("shop.Cart", "9")]


def publish_across_aggregates(count: int) -> list[OutboxEvent]:
    rows = []
    with transaction.atomic():
        for position in range(count):
            aggregate = AGGREGATES[position % len(AGGREGATES)]
            rows += publish(
                Step(position=position),
                aggregate=aggregate,
                headers={"correlation_id": f"req-{position}"},
                tenant_id="acme",
            )
    return rows


def configure(settings, url: str, exchange: str, **options) -> None:
    settings.OUTBOX_PUBLISHERS = {
        "bus": {"URL": url, "EXCHANGE": exchange, "CONFIRM_TIMEOUT": 10, **options}
    }


def configure_proxied(settings, proxy, exchange: str) -> None:
    """The publisher "bus" to RabbitMQ through ``proxy``, which a test cuts."""
    url = through(RABBITMQ_URL, proxy.port)
    configure(settings, url, exchange, CONNECT_RETRIES=0)


@pytest.mark.parametrize("broker_name", ["rabbitmq", "redis"])
def test_committed_events_reach_the_broker_in_aggregate_order(
    request, broker_name, settings, unique
):
    broker = request.getfixturevalue(broker_name)
    queue = broker.bind(f"{unique}-q", unique)
    configure(settings, broker.url, unique, ORDERED=True)
    rows = publish_across_aggregates(30)
    with pytest.raises(RuntimeError), transaction.atomic():
        publish(Step(position=999), aggregate=AGGREGATES[0])
        raise RuntimeError("rolled back: never published")
    report = relay_once(kind="publisher", batch_size=7)
    assert (report.succeeded, report.failed) == (30, 0)
    messages = broker.drain(queue)
    assert sorted(m.properties["message_id"] for m in messages) == sorted(
        str(r.id) for r in rows
    )
    by_id = {str(r.id): r for r in rows}
    seen = defaultdict(list)
    for message in messages:
        event = body(message)
        row = by_id[event["id"]]
        assert event["type"] == "Step"
        assert event["source"] == "tests"
        assert (event["aggregatetype"], event["subject"]) == (
            row.aggregate_type,
            row.aggregate_id,
        )
        assert event["tenantid"] == "acme"
        assert event["correlationid"] == row.headers["correlation_id"]
        assert event["data"] == {"position": row.payload["position"]}
        assert message.delivery_info["routing_key"] == f"{row.aggregate_type}.Step"
        if broker.amqp:
            assert message.properties["delivery_mode"] == 2
        seen[event["subject"]].append(event["data"]["position"])
    for aggregate_id, positions in seen.items():
        assert positions == sorted(positions), aggregate_id
    assert kit.states("bus") == {State.SUCCEEDED: 30}


@pytest.mark.parametrize("broker_name", ["rabbitmq", "redis"])
def test_a_backlog_of_many_batches_is_sent_once_each(
    request, broker_name, settings, unique
):
    """Batches follow each other with one on the wire while the one before is
    confirmed: each event is sent once, none skipped."""
    broker = request.getfixturevalue(broker_name)
    queue = broker.bind(f"{unique}-q", unique)
    configure(settings, broker.url, unique)
    rows = []
    for start in range(0, 50, 10):
        with transaction.atomic():
            rows += publish(
                *[OrderPlaced(order_id=i, total=1) for i in range(start, start + 10)]
            )
    report = relay_once(kind="publisher", batch_size=8)
    assert (report.succeeded, report.failed) == (50, 0)
    ids = [m.properties["message_id"] for m in broker.drain(queue)]
    assert sorted(ids) == sorted(str(r.id) for r in rows)


@pytest.mark.parametrize("broker_name", ["rabbitmq", "redis"])
def test_a_message_the_broker_can_never_take_expires_alone_and_nothing_pauses(
    request, broker_name, settings, unique
):
    """An event type of 200 two-byte characters overflows the AMQP ``type``
    property (255 bytes): on RabbitMQ that row is DEAD after one attempt
    with the reason, the others are delivered, the publisher never pauses.
    Redis has no such limit: every row is delivered."""
    broker = request.getfixturevalue(broker_name)
    queue = broker.bind(f"{unique}-q", unique)
    configure(settings, broker.url, unique, ROUTING_KEY="{aggregate_type}")
    with transaction.atomic():
        rows = publish_across_aggregates(4)
        [odd] = publish(
            {"event_type": "é" * 200, "payload": {}}, aggregate=AGGREGATES[0]
        )
        rows += publish_across_aggregates(2)
    report = relay_once(kind="publisher")
    delivered = broker.drain(queue)
    assert not SubscriberPause.objects.exists()  # never paused
    if broker.amqp:
        assert (report.succeeded, report.dead, report.released) == (6, 1, 0)
        delivery = Delivery.objects.get(event_id=odd.id)
        assert (delivery.state, delivery.attempts) == (State.DEAD, 1)
        assert "'type' is 400 bytes" in delivery.last_error
        assert delivery.last_error_type == (
            "outbox_app.exceptions.UndeliverableMessage"
        )
    else:
        assert (report.succeeded, report.dead) == (7, 0)
        assert kit.deliveries([odd]) == {(odd.id, "bus"): State.SUCCEEDED}
        rows.append(odd)
    assert sorted(m.properties["message_id"] for m in delivered) == sorted(
        str(r.id) for r in rows
    )


def test_broker_outage__paused_no_attempt_spent_then_delivered(
    rabbitmq, proxy, settings, unique, caplog
):
    queue = rabbitmq.bind(f"{unique}-q", unique)
    configure_proxied(settings, proxy, unique)
    proxy.cut()
    with transaction.atomic():
        rows = publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(5)]
        )
    report = relay_once(kind="publisher")
    assert (report.succeeded, report.failed, report.released) == (0, 0, 5)
    # Handed back: due, no attempt counted.
    assert kit.states("bus") == {State.PENDING: 5}
    assert not Delivery.objects.filter(attempts__gt=0).exists()
    pause = SubscriberPause.objects.paused().get()
    assert pause.subscriber == "bus" and "cannot connect" in pause.reason
    password = urllib.parse.urlsplit(RABBITMQ_URL).password
    assert f":{password}@" not in pause.reason  # the password stays out of it
    paused = [r for r in caplog.records if "publisher paused" in r.getMessage()]
    assert len(paused) == 1
    # Paused: no claims (the rows stay PENDING, untouched) until a probe runs.
    assert deliver(kind="publisher").claimed == 0
    assert rabbitmq.drain(queue) == []
    proxy.restore()
    later = timezone.now() + datetime.timedelta(seconds=60)
    assert deliver(kind="publisher", now=later).succeeded == 5
    assert not SubscriberPause.objects.paused().exists()
    ids = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert sorted(ids) == sorted(str(r.id) for r in rows)
    assert kit.states("bus") == {State.SUCCEEDED: 5}
    assert not Delivery.objects.filter(attempts__gt=1).exists()  # one attempt
    assert any("publisher resumed" in r.getMessage() for r in caplog.records)


def test_a_ten_minute_outage_expires_nothing(rabbitmq, proxy, settings, unique):
    """RabbitMQ unreachable for 10 minutes of a test clock, events published
    all along, the defaults' 10 attempts: none DEAD, none attempted, every
    event delivered once after."""
    queue = rabbitmq.bind(f"{unique}-q", unique)
    configure_proxied(settings, proxy, unique)
    start = timezone.now()
    published = []
    proxy.cut()
    for step in range(0, 600, 5):
        with transaction.atomic():
            published += publish(OrderPlaced(order_id=step, total=decimal.Decimal(1)))
        now = start + datetime.timedelta(seconds=step)
        report = relay_once(kind="publisher", now=now)
        assert report.succeeded == report.failed == report.dead == 0
    # Every one waits, none DEAD, none attempted.
    assert kit.states("bus") == {State.PENDING: len(published)} == {State.PENDING: 120}
    assert not Delivery.objects.filter(attempts__gt=0).exists()
    proxy.restore()
    end = start + datetime.timedelta(seconds=600 + 60)
    # Delivered by the next turns (stream delivery's first one resends the
    # batch it read before the outage).
    assert sum(deliver(kind="publisher", now=end).succeeded for _ in range(3)) == 120
    ids = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert sorted(ids) == sorted(str(r.id) for r in published)
    assert kit.states("bus") == {State.SUCCEEDED: 120}
    assert not Delivery.objects.filter(attempts__gt=1).exists()


def test_sigkill_mid_batch__nothing_lost_duplicates_only_the_unconfirmed(
    rabbitmq, proxy, settings, unique
):
    """The relay is killed while it waits for a batch's confirms (the proxy holds
    the broker's replies back). After the lease, another relay sends the batch
    again: consumers see every event, duplicates only from that one batch."""
    queue = rabbitmq.bind(f"{unique}-q", unique)
    with transaction.atomic():
        rows = publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(20)]
        )
    options = {
        "bus": {
            "URL": through(RABBITMQ_URL, proxy.port),
            "EXCHANGE": unique,
            "CONFIRM_TIMEOUT": 120,
        }
    }
    proxy.freeze()
    relay = publisher_relay(options, batch_size=8)
    try:
        wait_for(
            lambda: kit.taken() or relay.process.poll() is not None,
            60,
            "the relay to take a batch",
        )
        time.sleep(0.5)  # sent, and waiting for the confirms held back
    finally:
        relay.stop(signal.SIGKILL)
        proxy.thaw()
    configure(settings, RABBITMQ_URL, unique)
    later = timezone.now() + datetime.timedelta(minutes=5)
    assert deliver(kind="publisher", now=later).succeeded == 20
    ids = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert set(ids) == {str(r.id) for r in rows}  # nothing lost
    # Duplicates: at most the batches sent and never confirmed (the confirm
    # window holds two).
    assert len(ids) - 20 <= 16


@pytest.mark.slow
@pytest.mark.parametrize(
    "point",
    [
        "send:1:after",  # batch 1 on the wire, nothing confirmed
        "send:2:after",  # batch 2 on the wire, batch 1 not collected
        "collect:1:after",  # batch 1 confirmed, not marked yet
        "send:3:before",  # batch 1 marked, batch 2 still in flight
    ],
)
def test_sigkill_at_every_point_of_the_confirm_window(
    rabbitmq, settings, unique, point
):
    """Whenever the relay dies, every SUCCEEDED row's message is in the queue
    (marked only after its confirm), and after the lease another relay sends
    the rest: nothing lost, duplicates only from the unmarked batches."""
    queue = rabbitmq.bind(f"{unique}-q", unique)
    with transaction.atomic():
        rows = publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(40)]
        )
    options = {
        "bus": {
            "BACKEND": "tests.testapp.publishers.KillingPublisher",
            "URL": RABBITMQ_URL,
            "EXCHANGE": unique,
        }
    }
    relay = publisher_relay(options, batch_size=8, OUTBOX_TEST_KILL_AT=point)
    try:
        relay.process.wait(60)
    finally:
        code = relay.stop()
    assert code == -signal.SIGKILL, relay.text()[-3000:]
    first = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    # What is recorded delivered was confirmed: its message is in the queue.
    done = {
        str(event_id)
        for (event_id, _), state in kit.deliveries(rows).items()
        if state == State.SUCCEEDED
    }
    assert done <= set(first)
    configure(settings, RABBITMQ_URL, unique)
    later = timezone.now() + datetime.timedelta(minutes=5)
    assert deliver(kind="publisher", now=later).succeeded == 40 - len(done)
    ids = first + [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert set(ids) == {str(r.id) for r in rows}  # nothing lost
    # Duplicates: only what was sent and not recorded delivered, at most the
    # two batches of the confirm window and one claimed ahead.
    assert len(ids) - 40 <= min(40 - len(done), 3 * 8)


@skipUnlessDBFeature("has_select_for_update_skip_locked")
def test_two_relays_20000_events__none_twice_none_lost(rabbitmq, settings, unique):
    queue = rabbitmq.bind(f"{unique}-q", unique)
    total = 20_000
    with transaction.atomic():
        for start in range(0, total, 1000):
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i))
                    for i in range(start, start + 1000)
                ]
            )
    options = {"bus": {"URL": RABBITMQ_URL, "EXCHANGE": unique}}
    relays = [publisher_relay(options, batch_size=500) for _ in range(2)]
    try:
        wait_for(
            lambda: kit.succeeded() == total,
            300,
            "two relays to deliver everything",
        )
    finally:
        codes = [relay.stop() for relay in relays]
    assert codes == [0, 0], [relay.text()[-2000:] for relay in relays]
    counts = [m.properties["message_id"] for m in rabbitmq.drain(queue)]
    assert len(counts) == total  # none twice
    assert len(set(counts)) == total  # none lost
    assert not Delivery.objects.filter(attempts__gt=1).exists()


def test_unroutable_rows_are_told_apart_for_requeue(rabbitmq, settings, unique):
    """An unroutable message is recorded as ``MessageUnroutable``, so
    ``outbox_requeue --error-type`` selects those rows and no others."""
    from io import StringIO

    from django.core.management import call_command

    rabbitmq.bind(f"{unique}-q", unique, "shop.Order.#")  # no queue for Cart
    configure(settings, rabbitmq.url, unique)
    publish_across_aggregates(6)
    report = relay_once(kind="publisher")
    assert (report.succeeded, report.failed) == (4, 2)
    kind = "outbox_app.exceptions.MessageUnroutable"
    failed = Delivery.objects.filter(state=State.FAILED)
    assert set(failed.values_list("last_error_type", flat=True)) == {kind}
    out = StringIO()
    call_command(
        "outbox_requeue", "--subscriber", "bus", "--error-type", kind, stdout=out
    )
    assert "Requeued 2 FAILED/DEAD deliveries of bus." in out.getvalue()


def test_who_acted_reaches_the_broker(rabbitmq, settings, unique, django_user_model):
    from django.test import RequestFactory

    from outbox_app.middleware import ActingMiddleware
    from tests.testapp.models import Product

    queue = rabbitmq.bind(f"{unique}-q", unique)
    configure(settings, rabbitmq.url, unique)
    user = django_user_model.objects.create(username="ana")

    def view(request):
        Product.objects.create(name="Sencha", price=1)

    request = RequestFactory().post("/products/", HTTP_X_REQUEST_ID="req-9")
    request.user = user
    ActingMiddleware(view)(request)
    assert relay_once(kind="publisher").succeeded == 1
    [message] = rabbitmq.drain(queue)
    event = body(message)
    assert event["actor"] == str(user.pk)
    assert json.loads(event["metadata"]) == {
        "method": "POST",
        "path": "/products/",
        "request_id": "req-9",
    }


def test_a_corewrite_subscriber_reads_tracked_changes_from_a_fanout_exchange(
    rabbitmq, settings, unique, django_user_model
):
    from outbox_app import acting
    from tests.testapp.models import Gadget

    queue = rabbitmq.bind(f"{unique}-search-indexer", unique, exchange_type="fanout")
    configure(
        settings, rabbitmq.url, unique, EXCHANGE_TYPE="fanout", FORMAT="corewrite"
    )
    with acting("ana@example.com", source="productManagement"):
        gadget = Gadget.objects.create(name="Widget Pro", price="99.99")
        gadget.price = "89.99"
        gadget.save()
        gadget.removed_at = timezone.now()
        gadget.save()
    Gadget.objects.create(name="Gone").delete()
    assert relay_once(kind="publisher").succeeded == 5
    messages = rabbitmq.drain(queue)
    # What the subscriber does: JSON.parse(msg.content), switch on EVENT_TYPE.
    index: dict[str, dict] = {}
    for message in messages:
        assert message.content_type == "application/json"
        event = json.loads(message.body)
        assert event["STATUS"] == "PUBLISHED" and len(event["CREATED_AT"]) == 14
        match event["EVENT_TYPE"]:
            case "GadgetCreated":
                index[event["AGGREGATE_ID"]] = dict(event["PAYLOAD"])
            case "GadgetUpdated":
                index[event["AGGREGATE_ID"]].update(event["PAYLOAD"])
                assert event["PREVIOUS_PAYLOAD"] == {
                    "price": "99.99",
                    "touched": event["PREVIOUS_PAYLOAD"]["touched"],
                }
            case "GadgetDeleted" | "GadgetForceDeleted":
                assert event["OPERATION"] == "DELETE"
                index.pop(event["AGGREGATE_ID"])
    assert index == {}
    first = json.loads(messages[0].body)
    assert first["AGGREGATE_TYPE"] == "Gadget" and first["OPERATION"] == "POST"
    assert first["PAYLOAD"]["id"] == gadget.pk
    assert first["PAYLOAD"]["price"] == "99.99"
    assert first["USER"] == "ana@example.com"
    assert first["METADATA"] == {"source": "productManagement"}
    assert [m.delivery_info["routing_key"] for m in messages] == [
        "gadget.post",
        "gadget.patch",
        "gadget.delete",
        "gadget.post",
        "gadget.delete",
    ]


def test_a_corewrite_subscriber_is_told_which_fields_a_large_row_left_out(
    rabbitmq, settings, unique
):
    from outbox_app import acting
    from tests.testapp.models import Product

    queue = rabbitmq.bind(f"{unique}-replica", unique, exchange_type="fanout")
    configure(
        settings, rabbitmq.url, unique, EXCHANGE_TYPE="fanout", FORMAT="corewrite"
    )
    settings.OUTBOX_MAX_PAYLOAD_BYTES = 180  # the row's values take about 220
    with acting("ana@example.com", source="catalog"):
        product = Product.objects.create(name="x" * 45, price=1, leaflet="l" * 90)
        product.leaflet = "m" * 90  # a change of the left-out field alone
        product.save()
    assert relay_once(kind="publisher").succeeded == 2
    created, updated = (json.loads(m.body) for m in rabbitmq.drain(queue))
    assert "leaflet" not in created["PAYLOAD"]
    assert created["METADATA"] == {"source": "catalog", "omitted": ["leaflet"]}
    # Without the names this update would read as no change at all.
    assert (updated["PAYLOAD"], updated["PREVIOUS_PAYLOAD"]) == ({"id": product.pk}, {})
    assert updated["METADATA"] == {"source": "catalog", "omitted": ["leaflet"]}
