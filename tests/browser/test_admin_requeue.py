"""End to end, in a real browser: an operator requeues dead deliveries in
the sample project's admin.

Starts the sample project (``manage.py``, ``sample_project.settings``) on a fresh
SQLite file with ``runserver``, seeds it with orders and deliveries, and drives
Debian's Chromium (``/usr/bin/chromium``) with Playwright. Playwright's own
browser downloads are never used.

Screenshots (1400 x 900 PNG, of fixed seeded data) go to a temporary
directory; with ``OUTBOX_SCREENSHOTS=1`` they replace the ones
``docs/operations.md`` shows, in ``docs/img/``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, require_service
from tests.kit import free_port, manage

#: The overview's state columns, in the order of ``outbox_app.store.lifecycle.State``.
STATE_VALUES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "DEAD", "SKIPPED"]
STATE_LABELS = ["pending", "running", "succeeded", "failed", "dead", "skipped"]
ROOT = Path(__file__).resolve().parents[2]
#: Where ``OUTBOX_SCREENSHOTS=1`` writes the screenshots: the docs' own.
DOCS_IMAGES = ROOT / "docs" / "img"
#: Every screenshot's size, in CSS pixels.
SCREEN = {"width": 1400, "height": 900}
USERNAME, PASSWORD = "operator", "correct horse battery staple"
EMAIL_HANDLER = "shop.send_confirmation"  # the sample shop's handler

pytestmark = [pytest.mark.slow, pytest.mark.services("chromium")]

#: Run inside the sample project (manage.py shell): orders with their events, and
#: deliveries in every state, successes spread over the last 24 hours.
SEED = f"""
import datetime, math, random
from decimal import Decimal
from django.utils import timezone
from outbox_app import Delivery, OutboxEvent
from sample_project.shop.services import place_order

random.seed(7)
now = timezone.now()
for i in range(300):
    place_order(f"customer{{i}}@example.com", Decimal(10 + i % 90))
events = list(OutboxEvent.objects.order_by("id"))
OutboxEvent.objects.update(fanned_out=True)
subscribers = [{EMAIL_HANDLER!r}, "rabbitmq"]

def minutes_ago():
    while True:  # busier in the (UTC) afternoon
        m = random.uniform(0, 1439)
        hour = ((now - datetime.timedelta(minutes=m)).hour + 24) % 24
        if random.random() < 0.35 + 0.65 * math.sin(math.pi * hour / 24) ** 2:
            return m

rows = []
for n, event in enumerate(events):
    for subscriber in subscribers:
        row = Delivery(
            event=event, subscriber=subscriber, event_type=event.event_type,
            aggregate_type=event.aggregate_type, aggregate_id=event.aggregate_id,
            state="SUCCEEDED", attempts=1, next_retry_at=now,
        )
        late = n >= len(events) - 3
        waiting = len(events) - 5 <= n < len(events) - 3
        if waiting and subscriber == {EMAIL_HANDLER!r}:
            row.state, row.attempts = "PENDING", 0
            row.created_at = now - datetime.timedelta(seconds=40)
        elif late and subscriber == {EMAIL_HANDLER!r}:
            row.state, row.attempts = "DEAD", 10
            row.last_error = "SMTPServerDisconnected: Connection unexpectedly closed"
            row.last_error_type = "smtplib.SMTPServerDisconnected"
            row.last_traceback = (
                "Traceback (most recent call last):\\n"
                '  File "shop/handlers.py", line 12, in send_confirmation\\n'
                "smtplib.SMTPServerDisconnected: Connection unexpectedly closed"
            )
            row.first_failed_at = row.completed_at = now - datetime.timedelta(hours=2)
        elif late and subscriber == "rabbitmq":
            row.state, row.attempts = "FAILED", 2
            row.last_error = "[Errno 111] Connection refused"
            row.last_error_type = "builtins.ConnectionRefusedError"
            row.next_retry_at = now + datetime.timedelta(seconds=30)
            row.first_failed_at = now - datetime.timedelta(minutes=4)
            row.created_at = now - datetime.timedelta(minutes=4)
        elif len(events) - 9 <= n < len(events) - 5 and subscriber == "rabbitmq":
            row.state, row.attempts = "SKIPPED", 3  # given up by an operator
            row.completed_at = now - datetime.timedelta(hours=1)
        else:
            row.completed_at = now - datetime.timedelta(minutes=minutes_ago())
        rows.append(row)
Delivery.objects.bulk_create(rows)
# What the shop's own consumer (manage.py consume) received: handled, one
# failing and one dead.
from outbox_app import InboxMessage
inbox = [
    InboxMessage(
        consumer="shop.consumed", message_id=str(event.id), queue="shop.events",
        event_type=event.event_type, state="HANDLED", attempts=1,
        received_at=now, handled_at=now,
    )
    for event in events[:-2]
]
inbox[-1].state, inbox[-1].handled_at = "DEAD", None
inbox[-1].last_error = "KeyError: 'order_id'"
inbox[-2].state, inbox[-2].handled_at = "FAILED", None
inbox[-2].next_retry_at = now + datetime.timedelta(seconds=20)
InboxMessage.objects.bulk_create(inbox)
dead = InboxMessage.objects.get(state="DEAD")
dead.body = '{{"specversion": "1.0", "type": "OrderPlaced", "data": {{"total": "12"}}}}'
dead.last_error_type = "builtins.KeyError"
dead.last_traceback = (
    "Traceback (most recent call last):\\n"
    '  File "shop/consumers.py", line 9, in consumed\\n'
    "KeyError: 'order_id'"
)
dead.attempts = 5
dead.save()
# The subscriptions a relay of the shop recorded a moment ago; one a former
# version had (no relay serves it now); an operator's pause; and an outage
# of the broker, which holds the newest deliveries back.
from outbox_app.models import SubscriberPause, Subscription
from outbox_app.relay import registry
from outbox_app.subscribers import Handler
Subscription.objects.record(registry.subscribers(), "shop-relay:4242", now)
Subscription.objects.record(
    [Handler(name="shop.legacy_export", event_types=frozenset({{"OrderPlaced"}}))],
    "shop-relay:1717",
    now - datetime.timedelta(hours=3),
)
Subscription.objects.filter(subscriber="shop.release_inventory").pause(
    "admin: alice", now - datetime.timedelta(minutes=12)
)
SubscriberPause.objects.create(
    subscriber="broker",
    paused_at=now - datetime.timedelta(minutes=3),
    resume_at=now + datetime.timedelta(hours=1),
    probes=5,
    reason="cannot connect to amqp://guest:**@rabbit:5672//: [Errno 111] "
    "Connection refused",
)
Delivery.objects.bulk_create(
    Delivery(
        event=event, subscriber="broker", event_type=event.event_type,
        aggregate_type=event.aggregate_type, aggregate_id=event.aggregate_id,
        state="PENDING", next_retry_at=now - datetime.timedelta(minutes=3),
        created_at=now - datetime.timedelta(minutes=3),
    )
    for event in events[-3:]
)
print("seeded", len(events), "events,", len(rows), "deliveries")
"""


def wait_until_up(url: str, server: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"runserver exited:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.2)
    pytest.fail(f"runserver did not answer at {url}:\n{log.read_text()}")


@pytest.fixture(scope="module")
def sample_site(tmp_path_factory):
    """The sample project served by runserver on a free port; yields its URL
    and the environment its ``manage.py`` runs with."""
    tmp_path = tmp_path_factory.mktemp("sample")
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'sample.sqlite3'}",
        "DJANGO_SUPERUSER_USERNAME": USERNAME,
        "DJANGO_SUPERUSER_PASSWORD": PASSWORD,
        "DJANGO_SUPERUSER_EMAIL": "operator@example.com",
        "PYTHONWARNINGS": "ignore",
    }
    manage("migrate", "--noinput", env=env)
    manage("createsuperuser", "--noinput", env=env)
    manage("shell", "-c", SEED, env=env)
    port = free_port()
    log = tmp_path / "runserver.log"
    with log.open("w") as out:
        server = subprocess.Popen(
            [
                sys.executable,
                "manage.py",
                "runserver",
                f"127.0.0.1:{port}",
                "--noreload",
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(f"{base}/admin/login/", server, log)
        yield base, env
    finally:
        server.terminate()
        server.wait(timeout=10)


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    """Where the screenshots go: ``docs/img`` with ``OUTBOX_SCREENSHOTS=1``
    (to refresh the docs' pictures), else a temporary directory."""
    if os.environ.get("OUTBOX_SCREENSHOTS") == "1":
        return DOCS_IMAGES
    return tmp_path_factory.mktemp("screenshots")


def shoot(page, path: Path) -> None:
    """A 1400 x 900 PNG of what the page shows, the clock's seconds hidden
    (times that change from run to run are not what it shows)."""
    assert page.viewport_size == SCREEN, page.viewport_size
    page.screenshot(path=str(path), animations="disabled", caret="hide")


@pytest.fixture(scope="module")
def browser():
    require_service("chromium")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM,
            args=[
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
            ],
        )
        try:
            yield browser
        finally:
            browser.close()


def log_in(browser, site: str, width: int = SCREEN["width"]):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": width, "height": SCREEN["height"]})
    page.set_default_timeout(15_000)
    page.goto(f"{site}/admin/")
    page.fill("#id_username", USERNAME)
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(USERNAME)
    return page


def seconds(text: str) -> float | None:
    """The overview's durations back to seconds: "1 min 5 s" -> 65; "-" -> None."""
    if text == "-":
        return None
    units = {"d": 86400, "h": 3600, "min": 60, "s": 1}
    parts = text.split()
    pairs = zip(parts[::2], parts[1::2], strict=True)
    return sum(int(n) * units[unit] for n, unit in pairs)


def test_overview_numbers_sit_under_their_headers(sample_site, browser):
    """Every number of the per-subscriber table, read by its header's name at
    1280 px, equals ``outbox_status --json`` (the table once had a cell more
    than headers: LAG showed the SKIPPED count)."""
    site, env = sample_site
    page = log_in(browser, site, 1280)
    page.goto(f"{site}/admin/outbox_app/outboxoverview/")
    assert page.locator("h1").inner_text() == "Outbox overview"
    status = json.loads(manage("outbox_status", "--json", env=env).stdout)
    table = page.locator("#outbox-subscribers")
    headers = table.locator("thead th").all_inner_texts()
    assert [h.lower() for h in headers] == [
        "subscriber",
        "kind",
        *(label.lower() for label in STATE_LABELS),
        "scheduled",
        "lag",
        "blocked aggregates",
    ]
    rows = table.locator("tbody tr")
    shown = {}
    for i in range(rows.count()):
        cells = rows.nth(i).locator("th, td").all_inner_texts()
        assert len(cells) == len(headers), cells
        row = dict(zip((h.lower() for h in headers), cells, strict=True))
        shown[row["subscriber"].splitlines()[0]] = row
    expected = {row["name"]: row for row in status["subscribers"]}
    assert shown.keys() == expected.keys()
    for name, row in shown.items():
        want = expected[name]
        for state, label in zip(STATE_VALUES, STATE_LABELS, strict=True):
            assert row[label.lower()] == str(want["states"][state]), (name, state)
        assert row["scheduled"] == str(want["scheduled"]), name
        lag, want_lag = seconds(row["lag"]), want["oldest_pending_seconds"]
        if want_lag is None:
            assert lag is None, name
        else:  # the page was read a moment before outbox_status ran
            assert lag is not None and abs(lag - want_lag) <= 5, (name, row["lag"])
        blocked = want["blocked_aggregates"]
        assert row["blocked aggregates"] == ("-" if blocked is None else str(blocked))
    assert page.locator("#outbox-dead").inner_text() == str(status["dead"])
    assert page.locator("#outbox-blocked").inner_text() == str(
        status["blocked_aggregates"]
    )
    # The inbox's table, by its headers, against the JSON's "inbox".
    inbox = page.locator("#outbox-inbox")
    headers = [h.lower() for h in inbox.locator("thead th").all_inner_texts()]
    assert headers == ["consumer", "handled", "failed", "dead"]
    rows = inbox.locator("tbody tr")
    shown = {}
    for i in range(rows.count()):
        cells = rows.nth(i).locator("th, td").all_inner_texts()
        row = dict(zip(headers, cells, strict=True))
        shown[row.pop("consumer")] = row
    assert shown == {
        row["consumer"]: {state.lower(): str(n) for state, n in row["states"].items()}
        for row in status["inbox"]
    }
    assert shown["shop.consumed"]["dead"] == "1"


def test_operator_requeues_expired_deliveries(sample_site, browser, screenshots):
    from playwright.sync_api import expect

    sample_site, _ = sample_site
    page = log_in(browser, sample_site)

    # The overview, from the Outbox section of the admin.
    page.goto(f"{sample_site}/admin/outbox_app/")
    page.click("a:text-is('Overview')")
    expect(page.locator("h1")).to_have_text("Outbox overview")
    expect(page.locator("#outbox-dead")).to_have_text("3")
    expect(page.locator("#outbox-subscribers")).to_contain_text(EMAIL_HANDLER)
    expect(page.locator("#outbox-chart path.bars")).to_have_count(1)
    shoot(page, screenshots / "overview.png")

    # Open the dead deliveries.
    page.goto(f"{sample_site}/admin/")
    page.click("#content-main a:text-is('Deliveries')")
    state_filter = page.locator("#changelist-filter details[data-filter-title='state']")
    state_filter.locator("a:text-is('dead')").click()
    rows = page.locator("#result_list tbody tr")
    expect(rows).to_have_count(3)
    expect(page.locator("#result_list td.field-state_label")).to_have_text(
        ["● dead \u00d710"] * 3
    )

    # Select them and run "Requeue selected".
    page.check("#action-toggle")
    page.select_option("select[name=action]", "requeue_selected")
    shoot(page, screenshots / "admin-requeue.png")
    page.click("button[name=index]")
    success = page.locator("ul.messagelist li.success")
    expect(success).to_have_text("3 deliveries were requeued.")
    expect(rows).to_have_count(0)  # none is dead any more
    shoot(page, screenshots / "admin-requeue-done.png")

    # Their new state: pending, attempts reset, the last error kept.
    state_filter.locator("a:text-is('pending')").click()
    page.locator(
        "#changelist-filter details[data-filter-title='last error type'] "
        "a:text-is('smtplib.SMTPServerDisconnected')"
    ).click()
    expect(page.locator("#result_list td.field-subscriber_name")).to_have_text(
        [EMAIL_HANDLER] * 3
    )
    expect(page.locator("#result_list td.field-state_label")).to_have_text(
        ["● pending"] * 3
    )
    expect(page.locator("#result_list td.field-short_error").first).to_contain_text(
        "SMTPServerDisconnected"
    )


def overflow(page) -> dict[str, list[int]]:
    """[scrollWidth, clientWidth] of the page and of the list's results box."""
    return page.evaluate(
        "() => { const r = document.querySelector('.results') ||"
        " document.documentElement; const d = document.documentElement;"
        " return {page: [d.scrollWidth, d.clientWidth],"
        " results: [r.scrollWidth, r.clientWidth]}; }"
    )


@pytest.mark.parametrize(
    "name", ["outboxevent", "delivery", "inboxmessage", "subscription"]
)
def test_lists_fit_a_1400_px_screen(sample_site, browser, screenshots, name):
    """The events, deliveries, inbox messages and subscriptions lists show
    every column without scrolling sideways at 1400 px, ids on one line (full
    UUIDs wrapped over four lines and pushed the deliveries and error columns
    off screen)."""
    site, _ = sample_site
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/{name}/?o=-1")
    widths = overflow(page)
    shoot(page, screenshots / f"admin-{name}-list.png")
    for box, (scroll, width) in widths.items():
        assert scroll <= width, (name, box, scroll, width)
    if name == "delivery":
        ids = page.locator("#result_list td.field-event_link").all_inner_texts()
        assert ids and all(len(text) == 9 for text in ids), ids[:3]
        # The broker is paused by an outage: its rows say so, not "due".
        broker = page.locator("#result_list tr", has_text="broker")
        assert broker.count() == 3
        for text in broker.locator("td.field-next_retry").all_inner_texts():
            assert text == "paused: outage"


def test_operator_requeues_from_a_deliveries_page(sample_site, browser, screenshots):
    """A failed delivery's page offers the transitions its state allows;
    Requeue makes it pending and titles its error as the previous attempt's."""
    from playwright.sync_api import expect

    site, _ = sample_site
    page = log_in(browser, site)
    page.goto(
        f"{site}/admin/outbox_app/delivery/?state__exact=FAILED"
        "&subscriber__exact=rabbitmq"
    )
    page.locator("#result_list tbody tr th a").first.click()
    tools = page.locator(".object-tools button")
    expect(tools).to_have_text(["Requeue", "Retry now", "Dead-letter", "Skip"])
    headings = page.locator("fieldset h2")
    expect(headings).to_have_text(["Aggregate", "Last error", "Lease"])
    shoot(page, screenshots / "admin-delivery-page.png")
    page.locator(".object-tools button:text-is('Requeue')").click()
    expect(page.locator("ul.messagelist li.success")).to_have_text(
        "1 delivery was requeued."
    )
    expect(page.locator(".field-state_label .readonly")).to_have_text("● pending")
    expect(headings).to_have_text(
        ["Aggregate", "Previous attempt's error (kept as history)", "Lease"]
    )
    expect(page.locator(".object-tools button")).to_have_text(["Dead-letter"])


def test_the_subscriptions_list_shows_serving_and_paused(
    sample_site, browser, screenshots
):
    """Where the operator looks for a subscriber: whether a relay serves it
    now, and why it is paused (an outage of the broker, an operator)."""
    from playwright.sync_api import expect

    site, _ = sample_site
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/subscription/")
    expect(page.locator("h1")).to_have_text("Select subscription to view")

    def row(name: str):
        return page.locator("#result_list tbody tr", has_text=name)

    expect(row("broker").locator("td.field-paused")).to_contain_text(
        "destination unavailable"
    )
    expect(row("broker").locator("td.field-relay")).to_have_text("● serving")
    expect(row("shop.release_inventory").locator("td.field-paused")).to_contain_text(
        "by admin: alice"
    )
    expect(row("shop.legacy_export").locator("td.field-relay")).to_have_text(
        "● unserved"
    )
    # Served three hours before the site was set up, which on a loaded
    # machine may be a minute or two before this test runs.
    expect(row("shop.legacy_export").locator("td.field-last_served")).to_contain_text(
        re.compile(r"3 h \d+ min ago")
    )
    shoot(page, screenshots / "admin-subscription-list.png")


def test_operator_pauses_and_resumes_a_subscriber(sample_site, browser):
    """The actions, as an operator runs them; the deliveries list and the
    overview follow (the relay's side: tests/delivery/test_subscriptions.py)."""
    from playwright.sync_api import expect

    site, env = sample_site
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/subscription/?q=shop.fraud_check")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "pause_selected")
    page.click("button[name=index]")
    expect(page.locator("ul.messagelist li.success")).to_have_text(
        "1 subscriber was paused: its deliveries wait, with no attempt counted, "
        "until it is resumed."
    )
    expect(page.locator("#result_list td.field-paused")).to_contain_text(
        "by admin: operator"
    )
    status = json.loads(manage("outbox_status", "--json", env=env).stdout)
    assert [p["subscriber"] for p in status["paused_by_operator"]] == [
        "shop.release_inventory",
        "shop.fraud_check",
    ]
    page.goto(f"{site}/admin/outbox_app/outboxoverview/")
    expect(
        page.locator("#outbox-subscribers tr", has_text="shop.fraud_check")
    ).to_contain_text("paused by admin: operator")

    page.goto(f"{site}/admin/outbox_app/subscription/?q=shop.fraud_check")
    page.check("#action-toggle")
    page.select_option("select[name=action]", "resume_selected")
    page.click("button[name=index]")
    expect(page.locator("ul.messagelist li.success")).to_have_text(
        "1 subscriber was resumed: relays claim its deliveries again."
    )
    expect(page.locator("#result_list td.field-paused")).to_have_text("-")


def test_operator_requeues_from_an_inbox_messages_page(
    sample_site, browser, screenshots
):
    from playwright.sync_api import expect

    site, _ = sample_site
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/inboxmessage/?state__exact=DEAD")
    page.locator("#result_list tbody tr th a").first.click()
    expect(page.locator(".object-tools button")).to_have_text(["Requeue"])
    expect(page.locator(".field-next_retry .readonly")).to_have_text("-")
    shoot(page, screenshots / "admin-inboxmessage-page.png")
    page.locator(".object-tools button:text-is('Requeue')").click()
    expect(page.locator("ul.messagelist li.success")).to_have_text(
        "1 message requeued: consume runs it again."
    )
    expect(page.locator(".field-state_label .readonly")).to_have_text("failed")
    expect(page.locator(".field-next_retry .readonly")).to_have_text("due")
    # A handled message's page: no button, no stale next try.
    page.goto(f"{site}/admin/outbox_app/inboxmessage/?state__exact=HANDLED")
    page.locator("#result_list tbody tr th a").first.click()
    expect(page.locator(".object-tools button")).to_have_count(0)
    expect(page.locator(".field-next_retry .readonly")).to_have_text("-")


def test_requeue_all_matching_says_the_filter_in_words(sample_site, browser):
    from playwright.sync_api import expect

    site, _ = sample_site
    page = log_in(browser, site)
    page.goto(
        f"{site}/admin/outbox_app/delivery/?state__exact=FAILED"
        "&subscriber__exact=rabbitmq"
    )
    page.click("a.outbox-requeue-matching")
    expect(page.locator("#outbox-filters li")).to_have_text(
        ["State: failed", "Subscriber: rabbitmq"]
    )
    assert "__exact" not in page.locator("#content-main").inner_text()


def test_the_overview_refreshes_itself_and_its_counts_link(sample_site, browser):
    """A new dead delivery shows on the open overview within a few seconds,
    without a reload; the count links to the dead deliveries."""
    from playwright.sync_api import expect

    site, env = sample_site
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/outboxoverview/")
    page.evaluate("() => { window.outboxNotReloaded = true; }")
    before = int(page.locator("#outbox-dead").inner_text())
    manage(
        "shell",
        "-c",
        "from outbox_app import Delivery\n"
        "row = Delivery.objects.filter(state='SUCCEEDED').first()\n"
        "Delivery.objects.filter(pk=row.pk).update(state='DEAD')",
        env=env,
    )
    expect(page.locator("#outbox-dead")).to_have_text(str(before + 1), timeout=20_000)
    assert page.evaluate("() => window.outboxNotReloaded") is True
    page.locator("#outbox-dead a").click()
    expect(page.locator("h1")).to_have_text("Select delivery to view")
    assert "state__exact=DEAD" in page.url
    expect(page.locator("#result_list tbody tr")).to_have_count(before + 1)


#: Names and errors as real projects have them, one long word each (a
#: consumer's dotted name, a Kubernetes pod's host name, an error quoting a
#: constraint): what a list column cannot break at a space.
LONG_ROWS = """
import datetime
from django.utils import timezone
from outbox_app import InboxMessage
from outbox_app.models import Subscription
from outbox_app.subscribers import Handler
now = timezone.now()
InboxMessage.objects.get_or_create(
    consumer="billing.consumers.record_invoice_for_the_order_placed",
    message_id="0199e3a0-5b1c-7d2e-9f3a-4b5c6d7e8f90",
    defaults=dict(
        queue="billing.shop_events_for_invoices", event_type="OrderPlacedWithCustomer",
        state="FAILED", attempts=3, received_at=now,
        next_retry_at=now + datetime.timedelta(minutes=5),
        last_error_type="django.db.utils.IntegrityError",
        last_error='duplicate key value violates unique constraint '
        '"billing_invoice_order_id_customer_id_4f1c2d3e_uniq_constraint_key"',
    ),
)
Subscription.objects.record(
    [Handler(name="search_indexer.handlers.index_the_order_for_full_text_search",
             event_types=frozenset({"OrderPlacedWithCustomerDetails"}))],
    "shop-relay-deployment-6b7f9d8c5d-4xk2p.shop.svc.cluster.local:1234567",
    now,
)
"""


@pytest.mark.parametrize(
    "name", ["outboxevent", "delivery", "inboxmessage", "subscription"]
)
def test_lists_fit_beside_the_navigation_sidebar(sample_site, browser, name):
    """With Django's navigation sidebar open (as it is unless the operator
    closed it), the lists still fit their column at 1400 px, also with long
    names and errors: the inbox's and the subscriptions' were 793 and 873 px
    wide in 751."""
    site, env = sample_site
    manage("shell", "-c", LONG_ROWS, env=env)
    page = log_in(browser, site)
    page.goto(f"{site}/admin/outbox_app/{name}/?o=-1")
    assert page.locator("#nav-sidebar").is_visible()
    widths = overflow(page)
    for box, (scroll, width) in widths.items():
        assert scroll <= width, (name, box, scroll, width)
