"""``python manage.py relay``: --once, SIGTERM, wake-ups, database outages."""

from __future__ import annotations

import decimal
import logging
import re
import signal
import threading
import time
from io import StringIO

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import transaction

from outbox_app import publish
from outbox_app.store.lifecycle import State
from tests import kit
from tests.kit import free_port, scrape
from tests.processes import (
    Watched,
    kill_other_connections,
    loopback_only,
    spawn,
    wait_for,
)
from tests.testapp.events import OrderPlaced
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def place(n: int) -> None:
    with transaction.atomic():
        publish(*[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(n)])


def relay_process(*args: str, **env: str):
    return spawn("manage.py", "relay", "--settings=tests.settings", *args, **env)


def test_once__drains_and_prints_a_summary(handlers):
    handlers("record")
    place(30)
    out = StringIO()
    call_command("relay", "--once", "--batch-size", "7", stdout=out)
    text = out.getvalue()
    assert "[##############################] 60 outcomes (100% of due)" in text
    assert re.search(
        r"delivered 60, failed 0, dead 0, fanned out (30|0), .* deliveries/s", text
    )
    assert SideEffect.objects.count() == 60
    assert kit.states() == {State.SUCCEEDED: 60}


def test_once__only_handlers_or_publishers(handlers):
    handlers("record")
    place(3)
    out = StringIO()
    call_command("relay", "--once", "--only", "publishers", stdout=out)
    assert "delivered 0" in out.getvalue()  # no publisher configured here
    assert kit.states() == {State.PENDING: 6}
    call_command("relay", "--once", "--only", "handlers", stdout=StringIO())
    assert kit.states() == {State.SUCCEEDED: 6}


def test_bad_arguments_are_clear_errors():
    with pytest.raises(CommandError, match="--batch-size must be a positive"):
        call_command("relay", "--once", "--batch-size", "0")
    with pytest.raises(CommandError, match="invalid choice: 'elsewhere'"):
        call_command("relay", "--once", "--database", "elsewhere")


def test_sigterm__finishes_the_batch_releases_the_rest_exits_0(tmp_path, handlers):
    marker = tmp_path / "started"
    handlers("slow")  # recorded, as a deploy does
    place(40)
    relay = relay_process(
        "--batch-size",
        "10",
        OUTBOX_TEST_HANDLER_SETS="slow",
        OUTBOX_TEST_MARKER=str(marker),
    )
    try:
        wait_for(lambda: marker.exists() or relay.poll() is not None, 60, "a delivery")
        relay.send_signal(signal.SIGTERM)
        out, err = relay.communicate(timeout=60)
    finally:
        if relay.poll() is None:
            relay.kill()
            relay.communicate()
    assert relay.returncode == 0, err
    assert "delivered" in out
    states = kit.states()
    assert State.RUNNING not in states
    assert states.get(State.SUCCEEDED, 0) == SideEffect.objects.count() > 0
    assert states.get(State.PENDING, 0) > 0  # released, or not read yet
    assert sum(states.values()) == 40


def test_default_verbosity_tells_what_a_long_running_relay_does():
    """At the default verbosity: start-up with the subscribers, then a line
    when a backlog is found and one when it is drained; no line per batch."""
    relay = relay_process(OUTBOX_TEST_HANDLER_SETS="record")
    log = Watched(relay)
    try:
        wait_for(lambda: log.has("relay started"), 60, "the relay to start")
        assert log.has(r"subscribers=.*record_a\(handler\)"), log.text()
        place(30)
        wait_for(lambda: log.has("backlog drained"), 60, "the backlog to drain")
    finally:
        code = log.stop()
    assert code == 0, log.text()
    assert log.has("relay busy: events to deliver"), log.text()
    assert log.has(r"relay idle: backlog drained in [\d.]+ s, .*succeeded=60")
    assert not log.has("relay iteration"), log.text()


def test_a_project_logging_config_prints_each_line_once(handlers):
    """With the project's own root handler, ``-v 2`` prints through it, once
    (the command used to add a handler of its own as well: every line twice)."""
    place(2)
    relay = spawn(
        "manage.py",
        "relay",
        "--settings=tests.logging_settings",
        "--once",
        "-v",
        "2",
        OUTBOX_TEST_HANDLER_SETS="record",
    )
    _, err = relay.communicate(timeout=60)
    assert relay.returncode == 0, err
    started = [line for line in err.splitlines() if "relay started" in line]
    assert len(started) == 1, err
    assert started[0].startswith("PROJECT INFO relay started"), err
    assert len([line for line in err.splitlines() if "relay iteration" in line]) == 1


def test_wakes_within_a_poll_by_notify_or_on_commit(vendor):
    """With a 60 s poll interval, the relay delivers an event published while it
    is idle because it is woken: by LISTEN/NOTIFY on PostgreSQL."""
    if vendor != "postgresql":
        # Elsewhere the wake-up is in-process (the relay thread below) plus
        # adaptive polling; covered by test_in_process_wakeup.
        return
    relay = relay_process(
        "-v", "3", OUTBOX_TEST_HANDLER_SETS="record", OUTBOX_TEST_POLL="60"
    )
    log = Watched(relay)
    try:
        wait_for(
            lambda: log.has("wake=listen/notify"), 60, "the relay to start listening"
        )
        time.sleep(1.0)  # let it go idle on a long wait
        place(1)
        wait_for(lambda: SideEffect.objects.count() == 2, 30, "delivery after NOTIFY")
        assert log.has("relay woken wake=notify"), log.text()
    finally:
        code = log.stop()
    assert code == 0, log.text()


def test_in_process_wakeup(handlers):
    """A relay running in the publishing process is woken by the on-commit
    signal on every database."""
    from outbox_app.relay.worker import RelayWorker

    handlers("record")
    worker = RelayWorker(poll_interval=60)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
        place(1)
        wait_for(lambda: SideEffect.objects.count() == 2, 30, "in-process wake-up")
    finally:
        worker.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_survives_losing_its_database_connection(vendor):
    # Persistent connections, as in production: the killed one is reused and fails.
    relay = relay_process(
        "-v",
        "2",
        OUTBOX_TEST_HANDLER_SETS="record",
        OUTBOX_TEST_POLL="0.2",
        OUTBOX_TEST_CONN_MAX_AGE="0",
    )
    log = Watched(relay)
    try:
        place(2)
        wait_for(lambda: SideEffect.objects.count() == 4, 60, "first deliveries")
        killed = kill_other_connections()
        if vendor != "sqlite":
            assert killed >= 1
        place(3)
        wait_for(
            lambda: SideEffect.objects.count() == 10, 60, "deliveries after the outage"
        )
        assert relay.poll() is None
    finally:
        code = log.stop()
    assert code == 0, log.text()
    if vendor != "sqlite":
        assert log.has("relay database error"), log.text()
    # One line per reconnect attempt: the broken LISTEN connection adds none.
    problems = [line for line in log.lines if re.search(r" (WARNING|ERROR) ", line)]
    assert all("relay database error (attempt" in p for p in problems), log.text()


def test_metrics_port_binds_loopback_unless_metrics_host_says_otherwise():
    """The metrics server checks no credentials: ``--metrics-port`` alone
    listens on 127.0.0.1 only; ``--metrics-host 0.0.0.0`` on every interface."""
    for host, only in (((), True), (("--metrics-host", "0.0.0.0"), False)):
        port = free_port()
        relay = Watched(relay_process("--metrics-port", str(port), *host))
        try:
            assert loopback_only(port) is only, host
            # The metrics server listens before the relay handles SIGTERM:
            # stop it once it runs, so it stops cleanly.
            wait_for(lambda r=relay: r.has("relay started"), 60, "the relay to start")
        finally:
            code = relay.stop()  # one at a time: SQLite allows one relay
        assert code == 0, relay.text()


def test_metrics_port_serves_the_relays_counters():
    """``relay --metrics-port``: outcomes, failures by error class, batch
    durations and latency, read from the running process."""
    port = free_port()
    place(5)
    relay = relay_process(
        "--metrics-port", str(port), OUTBOX_TEST_HANDLER_SETS="record,broken"
    )
    log = Watched(relay)

    failed = (
        "outbox_relay_outcomes_total",
        (("outcome", "failed"), ("subscriber", "broken")),
    )
    snapshot: dict = {}

    ok = ("outcome", "succeeded")
    succeeded = ("outbox_relay_outcomes_total", (ok, ("subscriber", "record_a")))

    def counted() -> bool:
        snapshot.clear()
        snapshot.update(scrape(port))
        # The broken handler retries on: 5 failures at least.
        return snapshot.get(failed, 0) >= 5 and snapshot.get(succeeded) == 5

    try:
        wait_for(counted, 60, "the failures counted")
    finally:
        code = log.stop()
    assert code == 0, log.text()
    error = ("error", "builtins.ValueError")
    failures = snapshot[
        ("outbox_relay_failures_total", (error, ("subscriber", "broken")))
    ]
    # Every failed attempt by its class (counted just before its outcome).
    assert snapshot[failed] <= failures <= snapshot[failed] + 1
    count = ("outbox_relay_batch_seconds_count", (("subscriber", "record_a"),))
    assert snapshot[count] >= 1
    latency = (
        "outbox_relay_delivery_latency_seconds_count",
        (("subscriber", "record_a"),),
    )
    assert snapshot[latency] == 5
    # Only delivered rows have a latency: the broken handler's never succeed.
    never = ("outbox_relay_delivery_latency_seconds_count", (("subscriber", "broken"),))
    assert snapshot.get(never, 0) == 0
    calls = ("outbox_relay_handler_seconds_count", (("subscriber", "broken"),))
    assert snapshot[calls] >= 5  # each call, failed or not


def test_backlog_drained_tells_how_long_it_took(handlers, caplog):
    """Five 0.2 s handler calls drained in one iteration: the line says 1 s
    or more (it counted from the end of that iteration: 0.0 s)."""
    from outbox_app.relay.worker import RelayWorker

    caplog.set_level(logging.INFO, logger="outbox_app.relay.worker")
    handlers("slow")
    place(5)
    worker = RelayWorker(poll_interval=0.1)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: "backlog drained" in caplog.text, 30, "the backlog drained")
    finally:
        worker.stop()
        thread.join(30)
    drained = re.search(r"backlog drained in ([\d.]+) s, (.*)", caplog.text)
    assert drained, caplog.text
    assert float(drained[1]) >= 1.0, caplog.text
    assert "succeeded=5" in drained[2]
