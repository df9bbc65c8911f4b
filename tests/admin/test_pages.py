"""Admin pages: lists, filters, search, details, escaping, read-only rules, the
overview and its JSON."""

from __future__ import annotations

import datetime
import json
import re

import pytest
from django.contrib.admin.models import LogEntry
from django.db import transaction
from django.urls import reverse
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent, outbox_action
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events, subscribed

pytestmark = pytest.mark.django_db

DELIVERIES = reverse("admin:outbox_app_delivery_changelist")
EVENTS = reverse("admin:outbox_app_outboxevent_changelist")
OVERVIEW = reverse("admin:outbox_app_overview")
OVERVIEW_JSON = reverse("admin:outbox_app_overview_json")
XSS = "<script>alert('outbox')</script>"


def event_page(event) -> str:
    return reverse("admin:outbox_app_outboxevent_change", args=[event.pk])


def delivery_page(row) -> str:
    return reverse("admin:outbox_app_delivery_change", args=[row.pk])


@pytest.fixture
def hostile():
    """An event and a failed delivery carrying markup in every free-text field."""
    (event,) = events(
        1,
        event_type="OrderPlaced",
        payload={"note": XSS, "nested": {"html": "<img src=x onerror=alert(1)>"}},
        headers={"correlation_id": XSS},
        aggregate=("shop.Order", XSS),
    )
    row = delivery(
        event,
        "ops.record",
        State.DEAD,
        last_error=f"ValueError: {XSS}",
        last_error_type="builtins.ValueError",
        last_traceback=(
            f'Traceback (most recent call last):\n  raise ValueError("{XSS}")'
        ),
    )
    return event, row


def assert_escaped(content: bytes) -> None:
    text = content.decode()
    assert "<script>alert(" not in text
    assert "<img src=x" not in text
    assert "&lt;script&gt;alert(" in text


def test_xss__event_detail_escapes_payload_headers_and_inline_errors(
    admin_client, hostile
):
    event, _ = hostile
    page = admin_client.get(event_page(event))
    assert page.status_code == 200
    assert_escaped(page.content)
    text = page.content.decode()
    assert "&lt;img src=x onerror=alert(1)&gt;" in text
    assert '<pre class="outbox-json">{\n  &quot;nested&quot;: {' in text  # pretty


def test_xss__delivery_list_and_detail_escape_the_error(admin_client, hostile):
    _, row = hostile
    for url in (DELIVERIES, delivery_page(row), EVENTS):
        page = admin_client.get(url)
        assert page.status_code == 200
        assert_escaped(page.content)
    detail = admin_client.get(delivery_page(row)).content.decode()
    assert "Traceback (most recent call last):" in detail  # the full traceback
    assert '<pre class="outbox-text">ValueError: &lt;script&gt;' in detail


def test_event_list__columns_and_delivery_summary(admin_client):
    (event,) = events(1, aggregate=("shop.Order", 7), aggregate_version=3)
    delivery(event, "a", State.SUCCEEDED)
    delivery(event, "b", State.SUCCEEDED)
    delivery(event, "c", State.FAILED)
    delivery(event, "d", State.DEAD)
    page = admin_client.get(EVENTS)
    text = page.content.decode()
    assert "shop.Order:7 v3" in text
    summary = re.search(
        r'title="2 succeeded, 1 failed, 1 dead"[^>]*>(.*?)</span>\s*</td', text, re.S
    )
    assert re.sub(r"<[^>]+>", "", summary.group(1)) == "2 / 1 / 1"
    # The column's header is its legend.
    assert re.search(r"<th[^>]*column-delivery_summary.*?</th>", text, re.S)
    header = re.search(r"<th[^>]*column-delivery_summary.*?</th>", text, re.S)[0]
    assert re.sub(r"<[^>]+>", " ", header).split()[-6:] == [
        "Deliveries",
        "succeeded",
        "/",
        "failed",
        "/",
        "dead",
    ]


def test_delivery_list__states_stand_out_next_attempt_only_when_due(
    admin_client,
):
    (event,) = events(1)
    done = delivery(event, "a", State.SUCCEEDED)
    expired = delivery(event, "b", State.DEAD)
    failed = delivery(event, "c", State.FAILED)
    text = admin_client.get(DELIVERIES).content.decode()
    assert "outbox-state-dead" in text and "● dead" in text
    assert "outbox-state-failed" in text

    def next_attempt(row) -> str:
        cells = re.search(
            rf'<a href="[^"]*/{row.pk}/change/">{row.pk}</a>.*?'
            r'<td class="field-next_retry[^"]*">(.*?)</td>',
            text,
            re.S,
        )
        return cells.group(1)

    assert next_attempt(done) == "-"
    assert next_attempt(expired) == "-"
    assert next_attempt(failed) not in ("-", "")


def test_event_list__the_fanned_out_column_says_so(admin_client):
    events(1)
    text = admin_client.get(EVENTS).content.decode()
    assert "Fanned out" in text
    assert "Delivered" not in text


@pytest.mark.parametrize(
    "query",
    [
        "event_type__exact=OrderPlaced",
        "aggregate_type__exact=shop.Order",
        "tenant_id__exact=t1",
        # Awaiting fan-out: row delivery's (stream delivery has none).
        pytest.param("fanned_out__exact=0", marks=pytest.mark.engine("rows")),
        "occurred_at__gte=2000-01-01+00:00:00%2B00:00",
    ],
)
def test_event_list__filters(admin_client, query):
    (event,) = events(1, aggregate=("shop.Order", 1), tenant_id="t1")
    events(1, event_type="Other")
    page = admin_client.get(f"{EVENTS}?{query}")
    assert page.status_code == 200
    assert str(event.pk) in page.content.decode()
    if "occurred" not in query and "fanned_out" not in query:
        assert page.context["cl"].result_count == 1


def test_event_list__search_by_ids(admin_client):
    (target,) = events(
        1, aggregate=("shop.Order", "A-1"), headers={"correlation_id": "req-42"}
    )
    events(2)
    with transaction.atomic(), outbox_action("Thing") as action_id:
        pass
    for term, expected in [
        (str(target.pk), target.pk),
        ("A-1", target.pk),
        ("req-42", target.pk),
        (str(action_id), OutboxEvent.objects.get(action_id=action_id).pk),
    ]:
        page = admin_client.get(EVENTS, {"q": term})
        assert [e.pk for e in page.context["cl"].result_list] == [expected], term


@pytest.mark.parametrize(
    "query",
    [
        "state__exact=DEAD",
        "subscriber__exact=a",
        "event_type__exact=OrderPlaced",
        "last_error_type__exact=builtins.ConnectionError",
        "attempts=3",
        "next_retry_at__gte=2000-01-01+00:00:00%2B00:00",
    ],
)
def test_delivery_list__filters(admin_client, query):
    event = events(1)[0]
    expired = delivery(event, "a", State.DEAD)
    delivery(event, "b", State.SUCCEEDED, next_retry_at=timezone.now())
    page = admin_client.get(f"{DELIVERIES}?{query}")
    assert page.status_code == 200
    assert expired in page.context["cl"].result_list


def test_delivery_list__search(admin_client):
    first, second = events(2, aggregate=("shop.Order", "B-2"))
    a = delivery(first, "a", State.DEAD, last_error="socket timed out")
    b = delivery(second, "a", State.PENDING)
    for term, expected in [
        (str(a.pk), {a.pk}),
        (str(second.pk), {b.pk}),
        ("B-2", {a.pk, b.pk}),
        ("timed out", {a.pk}),
        ("OUT socket", {a.pk}),  # words, in any order and case
    ]:
        page = admin_client.get(DELIVERIES, {"q": term})
        assert {r.pk for r in page.context["cl"].result_list} == expected, term


def test_read_only__no_add_change_or_delete(admin_client, hostile):
    event, row = hostile
    assert (
        admin_client.get(reverse("admin:outbox_app_outboxevent_add")).status_code == 403
    )
    assert admin_client.get(reverse("admin:outbox_app_delivery_add")).status_code == 403
    for url in (event_page(event), delivery_page(row)):
        assert admin_client.post(url, {"state": "PENDING"}).status_code == 403
    for name, pk in [
        ("admin:outbox_app_outboxevent_delete", event.pk),
        ("admin:outbox_app_delivery_delete", row.pk),
    ]:
        assert (
            admin_client.post(reverse(name, args=[pk]), {"post": "yes"}).status_code
            == 403
        )
    assert b"delete_selected" not in admin_client.get(EVENTS).content
    assert b"delete_selected" not in admin_client.get(DELIVERIES).content
    assert OutboxEvent.objects.count() == 1
    assert Delivery.objects.get().state == State.DEAD


# --- overview -------------------------------------------------------------------------


@pytest.fixture
def busy():
    first, second = events(2)
    now = timezone.now()
    for minutes in (1, 1, 5, 90):
        delivery(
            first,
            f"done-{minutes}-{now.timestamp()}-{Delivery.objects.count()}",
            State.SUCCEEDED,
            completed_at=now - datetime.timedelta(minutes=minutes),
        )
    delivery(second, "ops.record", State.DEAD)
    delivery(first, "ops.record", State.PENDING, age=datetime.timedelta(minutes=3))


def test_overview__page(admin_client, busy):
    with subscribed("OrderPlaced"):
        page = admin_client.get(OVERVIEW)
    assert page.status_code == 200
    text = page.content.decode()
    assert 'id="outbox-subscribers"' in text
    assert ">ops.record</a>" in text
    assert re.search(r'id="outbox-dead"><a href="[^"]*state__exact=DEAD">1<', text)
    assert re.search(r'id="outbox-lag">3 min \d+ s<', text)
    # An inline SVG chart with bars, and no external asset anywhere on the page.
    svg = re.search(r"<svg class=\"outbox-chart\".*?</svg>", text, re.S).group(0)
    assert '<path class="bars"' in svg
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", text)


def test_overview__shows_paused_publishers(admin_client):
    from outbox_app.models import SubscriberPause
    from outbox_app.relay.sending import Pause

    now = timezone.now()
    SubscriberPause.objects.record(
        "rabbitmq", Pause(now, now, 2, "connection refused <b>"), None
    )
    page = admin_client.get(OVERVIEW).content.decode()
    assert 'id="outbox-paused"' in page
    assert "rabbitmq is paused" in page
    assert "connection refused &lt;b&gt;" in page  # escaped


def test_overview__a_malformed_broker_url_shows_its_password_masked(
    viewer_client, settings
):
    """View-only staff see the configuration error, not the password."""
    settings.OUTBOX_PUBLISHERS = {
        "rabbitmq": {"URL": "amqp://user:s3cret@host:notaport//"}
    }
    page = viewer_client.get(OVERVIEW, follow=True)
    text = page.content.decode()
    assert page.status_code == 200
    assert "s3cret" not in text
    assert "amqp://user:**@host:notaport//" in text


def test_overview__counts_the_inbox_per_consumer_under_its_headers(admin_client):
    from outbox_app.models import InboxMessage
    from outbox_app.store.lifecycle import InboxState

    counts = {
        ("billing.invoice", InboxState.HANDLED): 3,
        ("billing.invoice", InboxState.DEAD): 1,
        ("crm.<sync>", InboxState.FAILED): 2,
    }
    InboxMessage.objects.bulk_create(
        InboxMessage(
            consumer=consumer, message_id=f"{consumer}-{state}-{n}", state=state
        )
        for (consumer, state), count in counts.items()
        for n in range(count)
    )
    text = admin_client.get(OVERVIEW).content.decode()
    table = re.search(r'<table id="outbox-inbox">.*?</table>', text, re.S).group(0)
    headers = re.findall(r'<th scope="col"[^>]*>([^<]*)</th>', table)
    assert headers == ["consumer", "handled", "failed", "dead"]
    rows = {}
    for row in re.findall(r"<tr[^>]*>\s*<th scope=\"row\">(.*?)</tr>", table, re.S):
        name = re.search(r">([^<]*)</a>", row).group(1)
        cells = [
            re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td[^>]*>(.*?)</td>", row)
        ]
        rows[name] = dict(zip(headers[1:], map(int, cells), strict=True))
    assert rows == {
        "billing.invoice": {"handled": 3, "failed": 0, "dead": 1},
        "crm.&lt;sync&gt;": {"handled": 0, "failed": 2, "dead": 0},
    }
    assert "consumer__exact=billing.invoice&amp;state__exact=DEAD" in table


def test_overview__json(admin_client, busy):
    with subscribed("OrderPlaced"):
        data = admin_client.get(OVERVIEW_JSON).json()
    assert data["dead"] == 1
    assert data["deliveries"]["total"] == 4
    assert sum(data["deliveries"]["per_minute"]) == 4
    names = [row["name"] for row in data["subscribers"]]
    assert "ops.record" in names
    json.dumps(data)


def test_overview__links(admin_client):
    for url in (DELIVERIES, EVENTS):
        page = admin_client.get(url)
        assert f'href="{OVERVIEW}"'.encode() in page.content, url


def test_overview__listed_once_on_the_app_index(admin_client):
    """Once, as the Overview entry among the models (there was a second,
    "Monitoring" table whose description squeezed the link to "Overvie/w")."""
    page = admin_client.get(reverse("admin:app_list", args=["outbox_app"]))
    text = page.content.decode()
    assert text.count('<th scope="row" id="outbox_app-outboxoverview">') == 1
    assert f'<a href="{OVERVIEW}">Overview</a>' in text


def test_overview__needs_view_permission(client, viewer_client, django_user_model):
    assert viewer_client.get(OVERVIEW).status_code == 200
    assert viewer_client.get(OVERVIEW_JSON).status_code == 200
    staff = django_user_model.objects.create_user("bare", is_staff=True)
    client.force_login(staff)
    assert client.get(OVERVIEW).status_code == 403
    assert client.get(OVERVIEW_JSON).status_code == 403
    client.logout()
    response = client.get(OVERVIEW_JSON)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]
    assert not LogEntry.objects.exists()


def test_overview__listed_on_the_admin_index(admin_client, viewer_client):
    page = admin_client.get(reverse("admin:index"))
    url = reverse("admin:outbox_app_outboxoverview_changelist")
    assert url == OVERVIEW  # the overview admin serves the page itself
    assert url.encode() in page.content
    assert b"Outbox overview" in admin_client.get(url).content
    assert viewer_client.get(url).status_code == 200


def test_overview__its_first_addresses_redirect(admin_client):
    old = reverse("admin:outbox_app_delivery_changelist")
    assert admin_client.get(old + "overview/")["Location"] == OVERVIEW
    assert admin_client.get(old + "overview.json")["Location"] == OVERVIEW_JSON


def test_overview__the_chart_scales_to_recent_activity(admin_client, busy):
    """Deliveries of the last 90 minutes fill a 6-hour chart (in a 24-hour one
    they were a sliver at its right edge); ?hours= picks a range."""
    text = admin_client.get(OVERVIEW).content.decode()
    assert "Deliveries per minute, last 6 hours (UTC)" in text
    assert "<strong>6 h</strong>" in text and 'href="?hours=24"' in text
    text = admin_client.get(OVERVIEW + "?hours=1").content.decode()
    assert "Deliveries per minute, last hour (UTC)" in text
    assert "3 deliveries in 1 h" in text  # the one 90 minutes ago is outside
    text = admin_client.get(OVERVIEW + "?hours=7").content.decode()
    assert "last 6 hours" in text  # not a range: the automatic one


def test_former_addresses_redirect_to_the_delivery_pages(admin_client):
    """Bookmarks from before the model was named Delivery still land."""
    for old, new in [
        ("/admin/outbox_app/notification/", "/admin/outbox_app/delivery/"),
        (
            "/admin/outbox_app/notification/12/change/?_changelist_filters=x",
            "/admin/outbox_app/delivery/12/change/?_changelist_filters=x",
        ),
    ]:
        response = admin_client.get(old)
        assert (response.status_code, response["Location"]) == (301, new)
