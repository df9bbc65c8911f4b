"""Prometheus metrics from the database: outbox_status --format prometheus and
the metrics view agree with outbox_status --json."""

from __future__ import annotations

import datetime
import io
import json

import pytest
from django.core.management import call_command
from prometheus_client.parser import text_string_to_metric_families

from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

pytestmark = pytest.mark.django_db

TOKEN = "s3cret-token-for-tests"


def samples(text: str) -> dict[tuple[str, tuple], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.fixture
def outbox():
    first, second, third = events(3)
    delivery(first, "ops.record", State.PENDING, age=datetime.timedelta(minutes=5))
    delivery(second, "ops.record", State.FAILED)
    delivery(third, "ops.record", State.DEAD)
    delivery(first, "gone.handler", State.SUCCEEDED)


def command(*args: str) -> str:
    out = io.StringIO()
    call_command("outbox_status", *args, stdout=out)
    return out.getvalue()


def test_prometheus_format_equals_the_json(outbox):
    with subscribed("OrderPlaced"):
        text = command("--format", "prometheus")
        data = json.loads(command("--format", "json"))
    found = samples(text)
    for row in data["subscribers"]:
        for state, n in row["states"].items():
            key = (
                "outbox_deliveries",
                (("state", state.lower()), ("subscriber", row["name"])),
            )
            assert found[key] == n, key
    lag = found[("outbox_lag_seconds", (("subscriber", "ops.record"),))]
    by_name = {row["name"]: row for row in data["subscribers"]}
    assert abs(lag - by_name["ops.record"]["oldest_pending_seconds"]) < 5
    assert ("outbox_lag_seconds", (("subscriber", "gone.handler"),)) not in found
    assert (
        found[("outbox_events_awaiting_fanout", ())] == data["events_awaiting_fanout"]
    )
    assert ("outbox_publisher_paused", (("subscriber", "x"),)) not in found


@pytest.fixture
def token(settings) -> dict:
    """``OUTBOX_METRICS_TOKEN`` set; the header that sends it."""
    settings.OUTBOX_METRICS_TOKEN = TOKEN
    return {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}


def test_view_serves_the_same_text(client, outbox, token):
    with subscribed("OrderPlaced"):
        response = client.get("/outbox/metrics", **token)
    assert response.status_code == 200
    assert response["Content-Type"].startswith("text/plain; version=")
    found = samples(response.content.decode())
    key = ("outbox_deliveries", (("state", "dead"), ("subscriber", "ops.record")))
    assert found[key] == 1


def test_view_wants_the_token_when_one_is_set(client, settings, outbox):
    settings.OUTBOX_METRICS_TOKEN = TOKEN
    assert client.get("/outbox/metrics").status_code == 403
    wrong = {"HTTP_AUTHORIZATION": "Bearer nope"}
    assert client.get("/outbox/metrics", **wrong).status_code == 403
    right = {"HTTP_AUTHORIZATION": f"Bearer {TOKEN}"}
    assert client.get("/outbox/metrics", **right).status_code == 200


def test_view_without_a_token_is_closed_outside_debug(client, settings, outbox):
    """No ``OUTBOX_METRICS_TOKEN``: 403 saying to set it, unless DEBUG."""
    assert getattr(settings, "OUTBOX_METRICS_TOKEN", None) is None
    assert not settings.DEBUG
    response = client.get("/outbox/metrics")
    assert response.status_code == 403
    assert "set OUTBOX_METRICS_TOKEN" in response.content.decode()
    settings.DEBUG = True
    response = client.get("/outbox/metrics")
    assert response.status_code == 200
    key = ("outbox_deliveries", (("state", "dead"), ("subscriber", "ops.record")))
    assert samples(response.content.decode())[key] == 1


def test_a_routed_view_without_a_token_is_a_deploy_warning(settings):
    """``check --deploy`` warns (W006) while the view is routed and no token is
    set; plain ``check`` does not, nor with a token or without the route."""
    from django.core import checks

    def deploy_ids() -> list[str]:
        return [
            m.id
            for m in checks.run_checks(include_deployment_checks=True)
            if m.id.startswith("outbox.")
        ]

    assert getattr(settings, "OUTBOX_METRICS_TOKEN", None) is None
    assert "outbox.W006" in deploy_ids()
    [warning] = [
        m
        for m in checks.run_checks(include_deployment_checks=True)
        if m.id == "outbox.W006"
    ]
    assert "'outbox/metrics'" in warning.msg
    assert "OUTBOX_METRICS_TOKEN" in warning.msg
    assert "outbox.W006" not in [m.id for m in checks.run_checks()]
    settings.OUTBOX_METRICS_TOKEN = TOKEN
    assert "outbox.W006" not in deploy_ids()
    settings.OUTBOX_METRICS_TOKEN = None
    settings.ROOT_URLCONF = "tests.ops.urls"
    assert "outbox.W006" not in deploy_ids()


def test_a_short_token_is_a_check_error(settings):
    from outbox_app.ops.checks import check_settings

    settings.OUTBOX_METRICS_TOKEN = "short"
    assert [m.id for m in check_settings()] == ["outbox.E018"]


@pytest.mark.django_db(transaction=True)
def test_a_subscriber_an_operator_paused_is_a_series():
    from outbox_app.models import Subscription
    from outbox_app.subscribers import Handler

    handler = Handler(name="ops.audit", event_types=frozenset({"OrderPlaced"}))
    Subscription.objects.record([handler], "host:1")
    key = ("outbox_subscriber_paused_by_operator", (("subscriber", "ops.audit"),))
    assert key not in samples(command("--format", "prometheus"))
    Subscription.objects.filter(subscriber="ops.audit").pause(by="admin: alice")
    assert samples(command("--format", "prometheus"))[key] == 1
