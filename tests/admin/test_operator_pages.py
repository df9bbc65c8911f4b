"""What the admin shows and lets an operator do about paused subscribers,
the inbox's messages and the overview's live part (through the test client;
tests/browser drives the same pages in Chromium)."""

from __future__ import annotations

import datetime
import re

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import LogEntry
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from outbox_app.models import InboxMessage, SubscriberPause, Subscription
from outbox_app.store.lifecycle import InboxState, State
from outbox_app.subscribers import Handler
from tests.ops.factories import delivery, events

from .conftest import _staff

pytestmark = pytest.mark.django_db

DELIVERIES = reverse("admin:outbox_app_delivery_changelist")
SUBSCRIPTIONS = reverse("admin:outbox_app_subscription_changelist")
REQUEUE_MATCHING = reverse("admin:outbox_app_delivery_requeue_matching")
OVERVIEW = reverse("admin:outbox_app_overview")
LIVE = reverse("admin:outbox_app_overview_live")


def record(name: str, seconds_ago: float = 0, types=("OrderPlaced",)) -> None:
    seen = timezone.now() - datetime.timedelta(seconds=seconds_ago)
    Subscription.objects.record(
        [Handler(name=name, event_types=frozenset(types))], "host:1", seen
    )


def outage(name: str) -> None:
    now = timezone.now()
    SubscriberPause.objects.create(
        subscriber=name,
        paused_at=now - datetime.timedelta(minutes=2),
        resume_at=now + datetime.timedelta(seconds=30),
        probes=3,
        reason="ConnectionRefusedError: [Errno 111]",
    )


def client_with(*codenames: str) -> Client:
    """A staff user named "someone" (a new one each call) with these
    permissions on the outbox."""
    from django.contrib.auth.models import User

    User.objects.filter(username="someone").delete()
    client = Client()
    client.force_login(_staff("someone", "view_subscription", *codenames))
    return client


def act(client, action: str, rows) -> list[str]:
    response = client.post(
        SUBSCRIPTIONS,
        {"action": action, "index": "0", ACTION_CHECKBOX_NAME: [r.pk for r in rows]},
        follow=True,
    )
    assert response.status_code == 200
    return [str(m) for m in response.context["messages"]]


def actions_of(page) -> list[str]:
    form = page.context["action_form"]
    return [] if form is None else [v for v, _ in form.fields["action"].choices]


# --- pause and resume ------------------------------------------------------------


def test_pause_and_resume__their_own_permission_and_the_admin_log():
    record("audit", types=("OrderPlaced", "OrderPaid"))
    record("mailer")
    first = Subscription.objects.filter(subscriber="audit").first()

    requeuer = client_with("requeue_delivery")
    page = requeuer.get(SUBSCRIPTIONS)
    actions = actions_of(page)
    assert "pause_selected" not in actions and "retire_keeping_waiting" not in actions
    act(requeuer, "pause_selected", [first])
    assert not Subscription.objects.filter(paused_at__isnull=False).exists()

    pauser = client_with("pause_subscription")
    page = pauser.get(SUBSCRIPTIONS)
    actions = actions_of(page)
    assert {"pause_selected", "resume_selected"} <= set(actions)
    assert "retire_keeping_waiting" not in actions  # retire is another permission
    said = act(pauser, "pause_selected", [first])
    assert said == [
        "1 subscriber was paused: its deliveries wait, with no attempt counted, "
        "until it is resumed."
    ]
    # The whole subscriber: both its event types.
    assert set(
        Subscription.objects.filter(subscriber="audit").values_list(
            "paused_by", flat=True
        )
    ) == {"admin: someone"}
    assert Subscription.objects.get(subscriber="mailer").paused_at is None
    entries = LogEntry.objects.filter(change_message__startswith="Paused")
    assert entries.count() == 2 and {e.user.username for e in entries} == {"someone"}

    text = pauser.get(SUBSCRIPTIONS).content.decode()
    assert "by admin: someone" in text
    assert act(pauser, "pause_selected", [first]) == [
        "Nothing was paused: they were paused already."
    ]
    assert act(pauser, "resume_selected", [first]) == [
        "1 subscriber was resumed: relays claim its deliveries again."
    ]
    assert not Subscription.objects.filter(paused_at__isnull=False).exists()
    assert LogEntry.objects.filter(change_message="Resumed.").count() == 2


def test_retire__needs_the_retire_permission():
    record("gone", seconds_ago=3600)
    rows = Subscription.objects.filter(subscriber="gone")
    gone = rows.get()
    act(
        client_with("pause_subscription", "requeue_delivery"),
        "retire_keeping_waiting",
        [gone],
    )
    assert rows.get().retired_at is None
    said = act(client_with("retire_subscription"), "retire_keeping_waiting", [gone])
    assert said == ["1 subscription was retired; 0 waiting deliveries were skipped."]
    assert rows.get().retired_by == "admin: someone"


def test_subscriptions_list__serving_last_served_and_paused(admin_client):
    record("running")
    record("stopped", seconds_ago=180)
    record("gone", seconds_ago=3600)
    record("rabbitmq")
    outage("rabbitmq")
    Subscription.objects.filter(subscriber="running").pause("admin: alice")
    text = admin_client.get(SUBSCRIPTIONS).content.decode()
    rows = {
        re.search(r"field-subscriber[^>]*>(?:<a [^>]*>)?([^<]+)<", row)[1]: re.sub(
            r"\s+", " ", re.sub(r"<[^>]+>", " ", row)
        )
        for row in re.findall(r"<tr>(.*?)</tr>", text, re.S)
        if "field-subscriber" in row
    }
    assert "● serving" in rows["running"] and "by admin: alice" in rows["running"]
    assert "● no relay now" in rows["stopped"]
    assert re.search(r"3 min \d+ s ago", rows["stopped"])  # a slow request adds
    assert "● unserved" in rows["gone"] and "1 h 0 min ago" in rows["gone"]
    for served, names in {
        "serving": ["rabbitmq", "running"],
        "stale": ["stopped"],
        "unserved": ["gone"],
        "served": ["rabbitmq", "running", "stopped"],  # the former choice
    }.items():
        page = admin_client.get(SUBSCRIPTIONS, {"served": served})
        # Those of this test (``migrate`` recorded the test app's own).
        listed = [
            s.subscriber
            for s in page.context["cl"].result_list
            if s.subscriber in {"running", "stopped", "gone", "rabbitmq"}
        ]
        assert listed == names, served
    assert "destination unavailable" in rows["rabbitmq"]
    assert "for 2 min 0 s; next probe in" in rows["rabbitmq"]
    page = admin_client.get(
        reverse(
            "admin:outbox_app_subscription_change",
            args=[Subscription.objects.get(subscriber="running").pk],
        )
    )
    assert page.status_code == 200
    assert "by admin: alice" in page.content.decode()


# --- the rows a paused subscriber holds --------------------------------------


def test_deliveries_of_a_paused_subscriber_say_paused_not_due(admin_client):
    event = events(1)[0]
    delivery(event, "rabbitmq", State.PENDING)
    delivery(event, "audit", State.FAILED)
    delivery(event, "mailer", State.PENDING)
    done = delivery(event, "ledger", State.SUCCEEDED)
    outage("rabbitmq")
    record("audit")
    record("ledger")
    Subscription.objects.filter(subscriber__in=["audit", "ledger"]).pause("admin: bob")
    text = admin_client.get(DELIVERIES).content.decode()
    cells = dict(
        re.findall(
            r'field-subscriber_name">([^<]+)</td>.*?field-next_retry">(.*?)</td>',
            text,
            re.S,
        )
    )
    plain = {k: re.sub(r"<[^>]+>", "", v) for k, v in cells.items()}
    assert plain["rabbitmq"] == "paused: outage"
    assert plain["audit"] == "paused by an operator"
    assert plain["mailer"] == "due"
    assert plain["ledger"] == "-"  # finished: nothing is next
    page = admin_client.get(
        reverse("admin:outbox_app_delivery_change", args=[done.pk])
    ).content.decode()
    assert "paused" not in re.search(r"field-next_retry.*?</div>", page, re.S)[0]


def test_an_events_page_shows_no_next_try_for_finished_deliveries(admin_client):
    event = events(1)[0]
    delivery(event, "a", State.SUCCEEDED)
    delivery(event, "b", State.FAILED)
    text = admin_client.get(
        reverse("admin:outbox_app_outboxevent_change", args=[event.pk])
    ).content.decode()
    cells = [
        re.sub(r"<[^>]+>", "", c).strip()
        for c in re.findall(r'<td class="field-next_retry">(.*?)</td>', text, re.S)
    ]
    # The failed delivery is due an hour after it was written; the page is
    # rendered some seconds later on a loaded machine.
    assert cells[0] == "-"
    assert re.fullmatch(r"in (59 min \d{1,2} s|1 h 0 min)", cells[1]), cells


# --- the inbox message's page ------------------------------------------------------


def message(state: str, **fields) -> InboxMessage:
    return InboxMessage.objects.create(
        consumer="billing.invoice",
        message_id=f"m-{state}",
        state=state,
        attempts=3,
        next_retry_at=timezone.now() - datetime.timedelta(hours=1),
        **fields,
    )


def test_inbox_list__search_by_ids_and_words_of_the_error(admin_client):
    """Its search box takes what the deliveries' takes: exact ids, and words
    of the last error in any order and case (it matched exact ids only)."""
    dead = message(
        InboxState.DEAD,
        last_error="KeyError: 'order_id' in the invoice's payload",
        aggregate_id="B-2",
    )
    failed = message(InboxState.FAILED, last_error="connection to billing db lost")
    url = reverse("admin:outbox_app_inboxmessage_changelist")
    for term, expected in [
        ("m-DEAD", {dead.pk}),
        ("B-2", {dead.pk}),
        (str(failed.pk), {failed.pk}),
        ("order_id", {dead.pk}),
        ("PAYLOAD keyerror", {dead.pk}),
        ('"billing db"', {failed.pk}),
        ("billing lost", {failed.pk}),
        ("lost payload", set()),
    ]:
        page = admin_client.get(url, {"q": term})
        assert {r.pk for r in page.context["cl"].result_list} == expected, term


def test_inbox_message_page__requeue_button(admin_client, viewer_client):
    dead = message(InboxState.DEAD, last_error="KeyError: 'order_id'")
    handled = message(InboxState.HANDLED, handled_at=timezone.now())
    page = reverse("admin:outbox_app_inboxmessage_change", args=[dead.pk])
    text = admin_client.get(page).content.decode()
    assert re.findall(
        r'<button type="submit" title="[^"]*">([^<]+)</button>', text
    ) == ["Requeue"]
    handled_page = admin_client.get(
        reverse("admin:outbox_app_inboxmessage_change", args=[handled.pk])
    ).content.decode()
    assert "<button" not in handled_page.split('id="content-main"')[1].split("<form")[0]
    # A handled message's next try is "-", not its stale next_retry_at.
    next_try = re.search(
        r"field-next_retry.*?<div class=\"readonly\">(.*?)</div>", handled_page, re.S
    )
    assert next_try[1].strip() == "-"

    url = reverse("admin:outbox_app_inboxmessage_requeue", args=[dead.pk])
    assert viewer_client.post(url).status_code == 403
    assert admin_client.get(url).status_code == 405
    response = admin_client.post(url, follow=True)
    assert response.redirect_chain[-1][0] == page
    assert [str(m) for m in response.context["messages"]] == [
        "1 message requeued: consume runs it again."
    ]
    dead.refresh_from_db()
    assert (dead.state, dead.attempts) == (InboxState.FAILED, 0)
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.change_message) == (str(dead.pk), "Requeued")


# --- requeue everything matching: the filter in words ------------------------------


def test_requeue_matching__says_the_filter_in_words(operator_client):
    event = events(1)[0]
    delivery(event, "shop.mailer", State.DEAD)
    text = operator_client.get(
        REQUEUE_MATCHING + "?state__exact=DEAD&subscriber__exact=shop.mailer&q=order"
    ).content.decode()
    described = re.search(r'<ul id="outbox-filters">(.*?)</ul>', text, re.S)[1]
    items = [
        re.sub(r"<[^>]+>", "", li) for li in re.findall(r"<li>(.*?)</li>", described)
    ]
    assert items == ["State: dead", "Subscriber: shop.mailer", "Search: order"]
    visible = re.sub(r"<[^>]+>", "", text.split('id="content-main"')[1])
    assert "__exact" not in visible


# --- the overview: links and the live part --------------------------------------


@pytest.mark.engine("rows")  # its event awaits fan-out
def test_overview__counts_link_to_their_filtered_lists(admin_client):
    event = events(1)[0]
    delivery(event, "ops.record", State.DEAD)
    delivery(event, "ops.other", State.FAILED)
    text = admin_client.get(OVERVIEW).content.decode()
    assert (
        f'href="{DELIVERIES}?subscriber__exact=ops.record&amp;state__exact=DEAD">1</a>'
        in text
    )
    assert (
        f'href="{DELIVERIES}?subscriber__exact=ops.other&amp;state__exact=FAILED">1</a>'
        in text
    )
    assert f'href="{DELIVERIES}?state__exact=DEAD">1</a>' in text  # the figure
    events_url = reverse("admin:outbox_app_outboxevent_changelist")
    assert f'href="{events_url}?fanned_out__exact=0">1</a>' in text
    for url in re.findall(r'href="([^"]*\?[^"]*)"', text):
        if url.startswith((DELIVERIES, events_url)):
            response = admin_client.get(url.replace("&amp;", "&"))
            assert response.status_code == 200, url  # a filter the list knows
            assert "?e=1" not in response.get("Location", ""), url


def test_overview__live_part_and_its_script(admin_client, viewer_client, client):
    event = events(1)[0]
    delivery(event, "ops.record", State.DEAD)
    page = admin_client.get(OVERVIEW).content.decode()
    assert f'data-url="{LIVE}"' in page and 'data-refresh-seconds="5"' in page
    assert re.search(r'<script src="/static/outbox_app/overview.js" defer>', page)
    live = viewer_client.get(LIVE)
    assert live.status_code == 200
    text = live.content.decode()
    assert 'id="outbox-subscribers"' in text and "<html" not in text
    assert "outbox-chart" not in text  # the chart is not read again
    delivery(event, "ops.other", State.DEAD)
    assert re.search(
        r'id="outbox-dead"><a [^>]*>2<', viewer_client.get(LIVE).content.decode()
    )
    assert client.get(LIVE).status_code == 302  # to the login page
