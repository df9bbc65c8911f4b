"""The shop's JSON API tested with pytest-django and outbox_app.testing's
fixtures (``outbox``, ``outbox_publishers``: ``sample_project/conftest.py``
enables them). Run with ``python -m pytest sample_project``."""

import pytest

from outbox_app.relay import relay_once

from .events import OrderPlaced

pytestmark = pytest.mark.django_db


def post(client, path: str, **body):
    return client.post(path, body, content_type="application/json")


def test_placing_an_order_publishes_and_confirms_it(client, outbox, mailoutbox):
    response = post(client, "/api/orders", email="bo@example.com", total="12.50")
    assert response.status_code == 201
    order_id = response.json()["order"]
    outbox.assert_published_once(
        OrderPlaced, order_id=order_id, customer_email="bo@example.com"
    )
    assert mailoutbox == []  # nothing delivered yet
    outbox.deliver_now()
    assert [m.to for m in mailoutbox] == [["bo@example.com"]]


def test_a_withdrawal_refused_publishes_nothing(client, outbox):
    response = post(client, "/api/wallets/bo@example.com/withdraw", amount="5")
    assert response.status_code == 409
    [rolled_back] = outbox.rolled_back
    assert response.json()["rolled_back_events"] == [str(rolled_back.id)]
    outbox.assert_not_published()


def test_the_broker_gets_a_cloudevent(client, outbox_publishers):
    post(client, "/api/wallets/bo@example.com/deposit", amount="20")
    relay_once()
    [message] = outbox_publishers.to("broker")
    assert message.content_type == "application/cloudevents+json"
    assert message.json()["type"] == "WalletDeposited"
    assert message.json()["data"] == {"owner": "bo@example.com", "amount": "20"}
