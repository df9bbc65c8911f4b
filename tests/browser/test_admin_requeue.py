"""End to end, in a real browser: an operator requeues dead deliveries in
the sample project's admin.

Starts the sample project (``manage.py``, ``sample_project.settings``) on a fresh
SQLite file with ``runserver``, seeds it with orders and deliveries, and drives
Debian's Chromium (``/usr/bin/chromium``) with Playwright. Playwright's own
browser downloads are never used. Saves its screenshots in ``artifacts/``;
``OUTBOX_SCREENSHOT_DIR=docs/img`` refreshes the ones ``docs/operations.md``
shows.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import CHROMIUM, require_service

#: The overview's state columns, in the order of ``outbox_app.store.lifecycle.State``.
STATE_VALUES = ["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "DEAD", "SKIPPED"]
STATE_LABELS = ["pending", "running", "succeeded", "failed", "dead", "skipped"]
ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / os.environ.get("OUTBOX_SCREENSHOT_DIR", "artifacts")
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
print("seeded", len(events), "events,", len(rows), "deliveries")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def manage(env: dict[str, str], *args: str) -> str:
    """Runs ``manage.py`` in the sample project; returns its stdout."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout


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
    manage(env, "migrate", "--noinput")
    manage(env, "createsuperuser", "--noinput")
    manage(env, "shell", "-c", SEED)
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


def log_in(browser, site: str, width: int):
    from playwright.sync_api import expect

    page = browser.new_page(viewport={"width": width, "height": 900})
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
    status = json.loads(manage(env, "outbox_status", "--json"))
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


def test_operator_requeues_expired_deliveries(sample_site, browser):
    from playwright.sync_api import expect

    sample_site, _ = sample_site
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page = log_in(browser, sample_site, 1440)

    # The overview, from the Outbox section of the admin.
    page.goto(f"{sample_site}/admin/outbox_app/")
    page.click("a:text-is('Overview')")
    expect(page.locator("h1")).to_have_text("Outbox overview")
    expect(page.locator("#outbox-dead")).to_have_text("3")
    expect(page.locator("#outbox-subscribers")).to_contain_text(EMAIL_HANDLER)
    expect(page.locator("#outbox-chart path.bars")).to_have_count(1)
    page.screenshot(path=str(SCREENSHOTS / "overview.png"), full_page=True)

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
    page.screenshot(path=str(SCREENSHOTS / "admin-requeue.png"))
    page.click("button[name=index]")
    success = page.locator("ul.messagelist li.success")
    expect(success).to_have_text("3 deliveries were requeued.")
    expect(rows).to_have_count(0)  # none is dead any more
    page.screenshot(path=str(SCREENSHOTS / "admin-requeue-done.png"))

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


def test_lists_fit_a_1400_px_screen(sample_site, browser):
    """The events and deliveries lists show every column without scrolling
    sideways at 1400 px, ids on one line (full UUIDs wrapped over four lines
    and pushed the deliveries and error columns off screen)."""
    site, _ = sample_site
    page = log_in(browser, site, 1400)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    for name in ("outboxevent", "delivery"):
        page.goto(f"{site}/admin/outbox_app/{name}/?o=-1")
        scroll, width = page.evaluate(
            "() => { const r = document.querySelector('.results');"
            " return [r.scrollWidth, r.clientWidth]; }"
        )
        page.screenshot(path=str(SCREENSHOTS / f"admin-{name}-list.png"))
        assert scroll <= width, (name, scroll, width)
    ids = page.locator("#result_list td.field-event_link").all_inner_texts()
    assert ids and all(len(text) == 9 for text in ids), ids[:3]


def test_operator_requeues_from_a_deliveries_page(sample_site, browser):
    """A failed delivery's page offers the transitions its state allows;
    Requeue makes it pending and titles its error as the previous attempt's."""
    from playwright.sync_api import expect

    site, _ = sample_site
    page = log_in(browser, site, 1280)
    page.goto(
        f"{site}/admin/outbox_app/delivery/?state__exact=FAILED"
        "&subscriber__exact=rabbitmq"
    )
    page.locator("#result_list tbody tr th a").first.click()
    tools = page.locator(".object-tools button")
    expect(tools).to_have_text(["Requeue", "Retry now", "Dead-letter", "Skip"])
    headings = page.locator("fieldset h2")
    expect(headings).to_have_text(["Aggregate", "Last error", "Lease"])
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / "admin-delivery-page.png"))
    page.locator(".object-tools button:text-is('Requeue')").click()
    expect(page.locator("ul.messagelist li.success")).to_have_text(
        "1 delivery was requeued."
    )
    expect(page.locator(".field-state_label .readonly")).to_have_text("● pending")
    expect(headings).to_have_text(
        ["Aggregate", "Previous attempt's error (kept as history)", "Lease"]
    )
    expect(page.locator(".object-tools button")).to_have_text(["Dead-letter"])
