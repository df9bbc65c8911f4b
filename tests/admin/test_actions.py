"""Admin actions through the test client: what they change, who may run them, and
what the admin log records."""

from __future__ import annotations

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.contenttypes.models import ContentType
from django.urls import reverse
from django.utils import timezone

from outbox_app import Delivery, OutboxEvent
from outbox_app.store.lifecycle import State
from tests.ops.factories import delivery, events

pytestmark = pytest.mark.django_db

DELIVERIES = reverse("admin:outbox_app_delivery_changelist")
EVENTS = reverse("admin:outbox_app_outboxevent_changelist")
REQUEUE_MATCHING = reverse("admin:outbox_app_delivery_requeue_matching")


def run_action(client, url, action, rows, **extra):
    data = {
        "action": action,
        "index": "0",
        ACTION_CHECKBOX_NAME: [r.pk for r in rows],
        **extra,
    }
    return client.post(url, data, follow=True)


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]]


def reload(*rows):
    return [type(r).objects.get(pk=r.pk) for r in rows]


@pytest.fixture
def rows():
    event = events(1)[0]
    return {
        state: delivery(event, f"sub-{state.lower()}", state)
        for state in (State.PENDING, State.FAILED, State.DEAD, State.SUCCEEDED)
    }


def test_requeue_selected__failed_and_expired_become_pending(admin_client, rows):
    before = timezone.now()
    response = run_action(admin_client, DELIVERIES, "requeue_selected", rows.values())

    assert response.status_code == 200
    assert messages_of(response) == [
        "2 deliveries were requeued. 2 selected deliveries were left as they were."
    ]
    failed, expired, pending, succeeded = reload(
        rows[State.FAILED],
        rows[State.DEAD],
        rows[State.PENDING],
        rows[State.SUCCEEDED],
    )
    for row in (failed, expired):
        assert row.state == State.PENDING
        assert row.attempts == 0
        assert before <= row.next_retry_at <= timezone.now()
        assert row.last_error == "broker down"
    assert pending.state == State.PENDING
    assert succeeded.state == State.SUCCEEDED


def test_requeue_selected__logs_one_entry_per_requeued_row(admin_client, rows):
    run_action(admin_client, DELIVERIES, "requeue_selected", rows.values())
    entries = LogEntry.objects.filter(
        content_type=ContentType.objects.get_for_model(Delivery)
    )
    assert sorted(int(e.object_id) for e in entries) == sorted(
        [rows[State.FAILED].pk, rows[State.DEAD].pk]
    )
    entry = entries.first()
    assert entry.action_flag == CHANGE
    assert entry.user.username == "admin"
    assert entry.get_change_message() == "Requeued: due now, attempts reset."


def test_requeue_selected__nothing_requeueable_is_a_warning(admin_client, rows):
    response = run_action(
        admin_client, DELIVERIES, "requeue_selected", [rows[State.PENDING]]
    )
    assert messages_of(response) == [
        "Nothing was requeued: only failed or dead deliveries can be."
    ]
    assert not LogEntry.objects.exists()


def test_retry_now__failed_rows_due_now_attempts_kept(admin_client, rows):
    response = run_action(admin_client, DELIVERIES, "retry_now", rows.values())
    assert messages_of(response)[0].startswith("1 failed delivery is due now.")
    (failed, expired) = reload(rows[State.FAILED], rows[State.DEAD])
    assert failed.state == State.FAILED
    assert failed.attempts == 3
    assert failed.next_retry_at <= timezone.now()
    assert expired.state == State.DEAD
    assert LogEntry.objects.get().object_id == str(failed.pk)


def test_dead_letter__pending_and_failed_stop(admin_client, rows):
    response = run_action(
        admin_client, DELIVERIES, "dead_letter_selected", rows.values()
    )
    assert messages_of(response)[0].startswith("2 deliveries were dead-lettered.")
    pending, failed, succeeded = reload(
        rows[State.PENDING], rows[State.FAILED], rows[State.SUCCEEDED]
    )
    assert (pending.state, failed.state) == (State.DEAD, State.DEAD)
    assert succeeded.state == State.SUCCEEDED
    assert LogEntry.objects.count() == 2


def test_skip_selected__failed_and_expired_are_given_up(admin_client, rows):
    response = run_action(admin_client, DELIVERIES, "skip_selected", rows.values())
    assert messages_of(response)[0].startswith("2 deliveries were skipped.")
    failed, expired, pending = reload(
        rows[State.FAILED], rows[State.DEAD], rows[State.PENDING]
    )
    assert (failed.state, expired.state) == (State.SKIPPED, State.SKIPPED)
    assert expired.completed_at is not None
    assert pending.state == State.PENDING
    assert LogEntry.objects.count() == 2


def test_select_across__acts_on_the_whole_filter_and_logs_one_entry(admin_client):
    event_rows = events(3)
    expired = [delivery(e, "a", State.DEAD) for e in event_rows]
    other = delivery(event_rows[0], "b", State.DEAD)
    response = run_action(
        admin_client,
        f"{DELIVERIES}?subscriber__exact=a",
        "requeue_selected",
        expired[:1],
        select_across="1",
    )
    assert messages_of(response) == ["3 deliveries were requeued."]
    assert {r.state for r in reload(*expired)} == {State.PENDING}
    assert reload(other)[0].state == State.DEAD
    entry = LogEntry.objects.get()
    assert entry.object_id is None
    assert entry.object_repr == "3 deliveries (subscriber__exact=a)"


def test_requeue_matching__confirms_then_requeues_only_the_filter(operator_client):
    event_rows = events(3)
    matching = [delivery(e, "a", State.DEAD) for e in event_rows]
    failed = delivery(event_rows[0], "b", State.FAILED)
    query = "?state__exact=DEAD&subscriber__exact=a"

    page = operator_client.get(REQUEUE_MATCHING + query)
    assert page.status_code == 200
    assert page.context["requeueable"] == 3
    assert b"3 failed or dead deliveries match" in page.content
    assert {r.state for r in reload(*matching)} == {State.DEAD}  # GET changes nothing

    response = operator_client.post(REQUEUE_MATCHING + query)
    assert response.status_code == 302
    assert response["Location"] == DELIVERIES + query
    assert {r.state for r in reload(*matching)} == {State.PENDING}
    assert reload(failed)[0].state == State.FAILED
    entry = LogEntry.objects.get()
    assert entry.user.username == "operator"
    assert entry.object_repr.startswith("3 deliveries (")


def test_requeue_matching__the_changelist_links_to_it_with_its_filter(operator_client):
    response = operator_client.get(DELIVERIES + "?state__exact=DEAD")
    assert f'href="{REQUEUE_MATCHING}?state__exact=DEAD"'.encode() in response.content


def test_requeue_matching__unknown_filter_goes_back(admin_client):
    response = admin_client.get(REQUEUE_MATCHING + "?nonsense__exact=1")
    assert response.status_code == 302
    assert response["Location"] == DELIVERIES


# --- outbox events ----------------------------------------------------------------


def test_requeue_deliveries__of_the_selected_events(admin_client):
    first, second = events(2)
    a = delivery(first, "a", State.DEAD)
    b = delivery(first, "b", State.FAILED)
    c = delivery(second, "a", State.DEAD)
    response = run_action(admin_client, EVENTS, "requeue_deliveries", [first])
    assert messages_of(response) == ["2 deliveries were requeued."]
    assert [r.state for r in reload(a, b, c)] == [
        State.PENDING,
        State.PENDING,
        State.DEAD,
    ]
    entry = LogEntry.objects.get()
    assert entry.object_id == str(first.pk)
    assert entry.content_type.model_class() is OutboxEvent


def test_replay__intermediate_page_then_replays(admin_client, replay_target):
    fresh, done = events(2)
    succeeded = delivery(done, replay_target, State.SUCCEEDED)

    page = run_action(admin_client, EVENTS, "replay_to_subscriber", [fresh, done])
    assert page.status_code == 200
    assert page.templates[0].name == "admin/outbox_app/outboxevent/replay.html"
    assert replay_target.encode() in page.content
    assert not Delivery.objects.filter(event=fresh).exists()

    response = run_action(
        admin_client,
        EVENTS,
        "replay_to_subscriber",
        [fresh, done],
        apply="1",
        subscriber=replay_target,
    )
    assert messages_of(response) == [
        "2 deliveries to late.handler are due now (1 new, 1 reset, 0 skipped)."
    ]
    created = Delivery.objects.get(event=fresh)
    assert (created.subscriber, created.state) == (replay_target, State.PENDING)
    assert reload(succeeded)[0].state == State.PENDING
    assert LogEntry.objects.count() == 2
    assert LogEntry.objects.first().get_change_message() == (
        "Replayed to subscriber late.handler."
    )


def test_replay__an_invalid_choice_shows_the_form_again(admin_client, replay_target):
    event = events(1)[0]
    page = run_action(
        admin_client, EVENTS, "replay_to_subscriber", [event], apply="1", subscriber="x"
    )
    assert page.status_code == 200
    assert "subscriber" in page.context["form"].errors
    assert not Delivery.objects.exists()


def test_replay__without_subscribers_says_so(admin_client, monkeypatch):
    from outbox_app.relay import registry

    monkeypatch.setattr(registry, "_handlers", {})  # not even autodiscovered ones
    event = events(1)[0]
    response = run_action(admin_client, EVENTS, "replay_to_subscriber", [event])
    assert messages_of(response) == [
        "No handler or publisher is configured: there is nobody to replay to."
    ]


# --- permissions --------------------------------------------------------------------


def test_viewer__sees_no_actions(viewer_client, rows):
    page = viewer_client.get(DELIVERIES)
    assert page.status_code == 200
    assert b"requeue_selected" not in page.content
    assert REQUEUE_MATCHING.encode() not in page.content
    assert viewer_client.get(EVENTS).status_code == 200
    assert b"replay_to_subscriber" not in viewer_client.get(EVENTS).content


def test_viewer__cannot_run_actions(viewer_client, rows, replay_target):
    event = rows[State.DEAD].event
    for url, action, selection in [
        (DELIVERIES, "requeue_selected", rows.values()),
        (DELIVERIES, "retry_now", rows.values()),
        (DELIVERIES, "dead_letter_selected", rows.values()),
        (EVENTS, "requeue_deliveries", [event]),
    ]:
        response = run_action(viewer_client, url, action, selection)
        assert response.status_code == 200  # the list again, nothing run
        assert messages_of(response) == []
    response = run_action(
        viewer_client,
        EVENTS,
        "replay_to_subscriber",
        [event],
        apply="1",
        subscriber=replay_target,
    )
    assert messages_of(response) == []
    assert viewer_client.get(REQUEUE_MATCHING).status_code == 403
    assert viewer_client.post(REQUEUE_MATCHING).status_code == 403
    assert [r.state for r in reload(*rows.values())] == list(rows)
    assert not LogEntry.objects.exists()


def test_operator__may_run_actions(operator_client, rows):
    response = run_action(
        operator_client, DELIVERIES, "requeue_selected", [rows[State.DEAD]]
    )
    assert messages_of(response) == ["1 delivery was requeued."]


def test_non_staff__is_sent_to_the_login_page(client, django_user_model):
    user = django_user_model.objects.create_user("visitor")
    client.force_login(user)
    response = client.get(REQUEUE_MATCHING)
    assert response.status_code == 302
    assert "/admin/login/" in response["Location"]


# --- subscriptions ---------------------------------------------------------------

SUBSCRIPTIONS = reverse("admin:outbox_app_subscription_changelist")


def subscription(name: str, seconds_ago: float):
    from outbox_app.models import Subscription
    from outbox_app.subscribers import Handler

    seen = timezone.now() - timezone.timedelta(seconds=seconds_ago)
    Subscription.objects.record(
        [Handler(name=name, event_types=frozenset({"OrderPlaced"}))], "host:1", seen
    )
    return Subscription.objects.get(subscriber=name)


def test_subscriptions__listed_filtered_retired_and_reactivated(admin_client):
    gone = subscription("gone", 3600)
    running = subscription("running", 0)
    waiting = delivery(events(1)[0], "gone", State.PENDING)

    page = admin_client.get(SUBSCRIPTIONS, {"served": "unserved"})
    assert page.status_code == 200
    assert [s.subscriber for s in page.context["cl"].result_list] == ["gone"]

    response = run_action(
        admin_client, SUBSCRIPTIONS, "retire_skipping_waiting", [gone]
    )
    assert messages_of(response) == [
        "1 subscription was retired; 1 waiting delivery was skipped."
    ]
    assert reload(gone)[0].retired_by == "admin: admin"
    assert reload(waiting)[0].state == State.SKIPPED
    entry = LogEntry.objects.get(object_id=str(gone.pk))
    assert entry.change_message == "Retired; its waiting deliveries skipped."

    response = run_action(
        admin_client, SUBSCRIPTIONS, "retire_keeping_waiting", [running]
    )
    assert "running <- OrderPlaced was refreshed" in messages_of(response)[0]
    assert reload(running)[0].retired_at is None

    response = run_action(admin_client, SUBSCRIPTIONS, "reactivate", [gone])
    assert messages_of(response) == ["1 subscription was reactivated."]
    assert reload(gone)[0].retired_at is None


def change_url(row) -> str:
    return reverse("admin:outbox_app_delivery_change", args=[row.pk])


def buttons_on(client, row) -> list[str]:
    import re

    page = client.get(change_url(row)).content.decode()
    return re.findall(r'<button type="submit" title="[^"]*">([^<]+)</button>', page)


def test_detail_page__offers_the_transitions_of_its_state(admin_client, rows):
    assert buttons_on(admin_client, rows[State.FAILED]) == [
        "Requeue",
        "Retry now",
        "Dead-letter",
        "Skip",
    ]
    assert buttons_on(admin_client, rows[State.DEAD]) == ["Requeue", "Skip"]
    assert buttons_on(admin_client, rows[State.PENDING]) == ["Dead-letter"]
    assert buttons_on(admin_client, rows[State.SUCCEEDED]) == []


def test_detail_page__requeue_then_the_error_is_history(admin_client, rows):
    row = rows[State.DEAD]
    Delivery.objects.filter(pk=row.pk).update(last_error="boom: refused")
    page = admin_client.get(change_url(row)).content.decode()
    assert "Last error" in page and "Previous attempt" not in page
    url = reverse("admin:outbox_app_delivery_transition", args=[row.pk, "requeue"])
    response = admin_client.post(url, {ACTION_CHECKBOX_NAME: row.pk}, follow=True)
    assert response.redirect_chain[-1][0] == change_url(row)
    assert messages_of(response) == ["1 delivery was requeued."]
    [row] = reload(row)
    assert (row.state, row.attempts) == (State.PENDING, 0)
    page = response.content.decode()
    assert "Previous attempt&#x27;s error (kept as history)" in page
    assert "boom: refused" in page
    entry = LogEntry.objects.get()
    assert (entry.object_id, entry.change_message) == (
        str(row.pk),
        "Requeued: due now, attempts reset.",
    )


def test_detail_page__transitions_need_the_permission_and_a_post(
    viewer_client, admin_client, rows
):
    row = rows[State.FAILED]
    assert buttons_on(viewer_client, row) == []
    url = reverse("admin:outbox_app_delivery_transition", args=[row.pk, "skip"])
    assert viewer_client.post(url, {ACTION_CHECKBOX_NAME: row.pk}).status_code == 403
    assert admin_client.get(url).status_code == 405
    bad = reverse("admin:outbox_app_delivery_transition", args=[row.pk, "nuke"])
    assert admin_client.post(bad).status_code == 404
    assert reload(row)[0].state == State.FAILED
    assert not LogEntry.objects.exists()
