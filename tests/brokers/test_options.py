"""KombuPublisher's configuration and confirm bookkeeping; no broker needed."""

from __future__ import annotations

import pytest
from django.core.exceptions import ImproperlyConfigured

from outbox_app.exceptions import DeliveryError
from outbox_app.publishers.base import build_publisher
from outbox_app.publishers.kombu import KombuPublisher, _Confirms

URL = "amqp://guest:guest@127.0.0.1:5672//"


def test_defaults():
    publisher = build_publisher("rabbitmq", {"URL": URL})
    assert isinstance(publisher, KombuPublisher)
    assert publisher.amqp
    assert publisher.exchange.name == "outbox"
    assert publisher.exchange.type == "topic"
    assert publisher.exchange.durable
    assert publisher.routing_key == "{aggregate_type}.{event_type}"
    assert publisher.confirm_timeout == 10
    assert publisher.queues == []
    assert publisher.where == "amqp://guest:**@127.0.0.1:5672//"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "memory://"])
def test_other_transports_have_no_confirms(url):
    assert not KombuPublisher("p", {"URL": url}).amqp


def test_confirm_publish_transport_option_is_dropped():
    publisher = KombuPublisher(
        "p", {"URL": URL, "TRANSPORT_OPTIONS": {"confirm_publish": True, "x": 1}}
    )
    assert publisher.transport_options == {"x": 1}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, "'URL' is required"),
        ({"URL": URL, "EXCHANGE_TYPE": "fan"}, "EXCHANGE_TYPE"),
        ({"URL": URL, "CONFIRM_TIMEOUT": 0}, "CONFIRM_TIMEOUT"),
        ({"URL": URL, "CONFIRM_TIMEOUT": "10"}, "CONFIRM_TIMEOUT"),
        ({"URL": URL, "DECLARE": "orders"}, "DECLARE"),
        ({"URL": URL, "TRANSPORT_OPTIONS": []}, "TRANSPORT_OPTIONS"),
        ({"URL": URL, "CONNECT_RETRIES": -1}, "CONNECT_RETRIES"),
        ({"URL": URL, "ROUTING_KEY": "{aggregate}.{event_type}"}, "['aggregate']"),
        ({"URL": URL, "ROUTING_KEY": "{}.x"}, "positional"),
        ({"URL": URL, "ROUTING_KEY": "{event_type"}, "ROUTING_KEY"),
        ({"URL": URL, "CONFIRM_TIMOUT": 5}, "unknown option(s) ['CONFIRM_TIMOUT']"),
        ({"URL": "nosuch://host/"}, "not a kombu URL"),
    ],
)
def test_malformed_options_are_refused(options, message):
    with pytest.raises(ImproperlyConfigured) as raised:
        KombuPublisher("rabbitmq", options)
    assert "OUTBOX_PUBLISHERS['rabbitmq']" in str(raised.value)
    assert message in str(raised.value)


def test_routing_key_may_use_attributes_and_items():
    publisher = KombuPublisher(
        "p", {"URL": "memory://", "ROUTING_KEY": "{namespace}.{headers[kind]}"}
    )
    assert publisher._key_fields == {"namespace", "headers"}


# --- _Confirms: which messages a stream of broker confirms settles -----------------


class Returned:
    def __init__(self, message_id):
        self.properties = {"message_id": message_id}


def test_single_and_multiple_acks_settle_each_message_once():
    confirms = _Confirms(first_tag=11, message_ids=list("abcdef"))
    confirms.on_ack(12, multiple=False)  # b
    confirms.on_ack(14, multiple=True)  # a, c, d (b already)
    assert confirms.waiting == 2
    assert confirms.outcomes[:4] == [None] * 4
    confirms.on_nack(16, multiple=False)  # f
    confirms.on_ack(15, multiple=True)  # e
    assert confirms.waiting == 0
    assert confirms.outcomes[4] is None
    assert isinstance(confirms.outcomes[5], DeliveryError)


def test_tags_of_other_batches_are_ignored():
    confirms = _Confirms(first_tag=11, message_ids=list("ab"))
    confirms.on_ack(3, multiple=False)
    confirms.on_ack(10, multiple=True)
    confirms.on_ack(99, multiple=False)
    assert confirms.waiting == 2


def test_a_returned_message_fails_even_though_it_is_acked():
    confirms = _Confirms(first_tag=1, message_ids=["a", "b", "c"])
    confirms.on_return(Exception("NO_ROUTE"), "ex", "key.b", Returned("b"))
    confirms.on_ack(3, multiple=True)
    assert confirms.outcomes[0] is None and confirms.outcomes[2] is None
    assert "unroutable" in str(confirms.outcomes[1])
    assert "'key.b'" in str(confirms.outcomes[1])


def test_fail_waiting_keeps_settled_outcomes_and_return_reasons():
    confirms = _Confirms(first_tag=1, message_ids=["a", "b", "c"])
    confirms.on_ack(1, multiple=False)
    confirms.on_return(Exception("NO_ROUTE"), "ex", "k", Returned("c"))
    confirms.fail_waiting(DeliveryError("timed out"))
    assert confirms.outcomes[0] is None
    assert str(confirms.outcomes[1]) == "timed out"
    assert "unroutable" in str(confirms.outcomes[2])
    assert confirms.waiting == 0
