"""The engine across real OS processes: a relay killed mid-handler, and several
relays draining one outbox side by side."""

from __future__ import annotations

import datetime
import decimal
import signal
from collections import defaultdict

import pytest
from django.db import connection, transaction
from django.test import skipUnlessDBFeature
from django.utils import timezone

from outbox_app import Delivery, publish
from outbox_app.relay import deliver
from outbox_app.store.lifecycle import State
from tests import kit
from tests.processes import spawn, wait_for
from tests.testapp.events import OrderPlaced, Step
from tests.testapp.models import SideEffect

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def start_worker(*args: str, **env: str):
    return spawn("-m", "tests.relay_worker", *args, **env)


@pytest.mark.engine("rows")
def test_sigkill_mid_handler__another_worker_delivers_after_the_lease(
    handlers, tmp_path
):
    marker = tmp_path / "started"
    with transaction.atomic():
        events = publish(
            *[OrderPlaced(order_id=i, total=decimal.Decimal(i)) for i in range(3)]
        )
    worker = start_worker("hang", "--batch-size", "1", OUTBOX_TEST_MARKER=str(marker))
    try:
        wait_for(  # the id written, not only the file made (write_text does both)
            lambda: (
                (marker.exists() and marker.read_text()) or worker.poll() is not None
            ),
            60,
            "the handler to start in the worker",
        )
        assert worker.poll() is None, worker.communicate()[1][-3000:]
        worker.send_signal(signal.SIGKILL)
    finally:
        if worker.poll() is None:
            worker.kill()
        worker.communicate(timeout=10)
    assert worker.returncode == -signal.SIGKILL
    running = Delivery.objects.filter(state=State.RUNNING)
    killed = running.get(event_id=marker.read_text())
    # On PostgreSQL and MariaDB the worker had claimed its next batch ahead
    # (one row): held until the lease runs out too.
    held = running.count()
    assert held in (1, 2)
    assert all(row.locked_by.endswith(f":{worker.pid}") for row in running)
    # The killed attempt's write was never committed.
    assert not SideEffect.objects.exists()
    # Before the lease runs out nobody may take the row; after, another worker does.
    handlers("record")  # a healthy "hang" replacement below, plus noise
    from outbox_app import handler
    from outbox_app.relay.registry import unregister
    from tests.testapp.scenarios import _record

    handler(OrderPlaced, name="hang")(
        lambda event, context: _record("hang", event, context)
    )
    try:
        assert deliver(subscribers=[_subscriber("hang")]).claimed == 3 - held
        assert Delivery.objects.get(id=killed.id).state == State.RUNNING
        later = timezone.now() + datetime.timedelta(seconds=61)
        report = deliver(subscribers=[_subscriber("hang")], now=later)
        assert (report.claimed, report.succeeded) == (held, held)
    finally:
        unregister("hang")
    killed.refresh_from_db()
    assert (killed.state, killed.attempts) == (State.SUCCEEDED, 2)
    hang_rows = SideEffect.objects.filter(handler="hang")
    assert sorted(
        str(e) for e in hang_rows.values_list("event_id", flat=True)
    ) == sorted(str(e.id) for e in events)


def _subscriber(name):
    from outbox_app.relay.registry import get

    return get(name)


@skipUnlessDBFeature("has_select_for_update_skip_locked")
def test_four_workers__flaky_and_ordered_handlers__nothing_lost_nothing_twice():
    aggregates, steps = 50, 20
    with transaction.atomic():
        for start in range(0, 5000, 250):
            publish(
                *[
                    OrderPlaced(order_id=i, total=decimal.Decimal(i))
                    for i in range(start, start + 250)
                ]
            )
        for position in range(steps):
            for aggregate in range(aggregates):
                publish(Step(position=position), aggregate=("shop.Cart", aggregate))
    workers = [
        start_worker(
            "flaky",
            "ordered",
            "--until-done",
            "--max-seconds",
            "400",
            OUTBOX_TEST_RETRY_BASE="0.01",
            OUTBOX_TEST_RETRY_MAX="0.05",
            OUTBOX_TEST_LEASE="120",
        )
        for _ in range(4)
    ]
    try:
        errors = [worker.communicate(timeout=450)[1] for worker in workers]
    finally:  # a failure leaves no process or open pipe to the next test
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
            worker.communicate(timeout=10)
    for worker, err in zip(workers, errors, strict=True):
        assert worker.returncode == 0, err[-3000:]
    assert kit.states() == {State.SUCCEEDED: 5000 * 2 + aggregates * steps}
    assert Delivery.objects.filter(attempts__gt=1).exists()  # failures did happen
    for name in ("flaky_a", "flaky_b"):
        effects = SideEffect.objects.filter(handler=name)
        assert effects.count() == 5000
        assert effects.values("event_id").distinct().count() == 5000
    seen = defaultdict(list)
    for aggregate, position in (
        SideEffect.objects.filter(handler="ordered")
        .order_by("id")
        .values_list("aggregate", "position")
    ):
        seen[aggregate].append(position)
    assert len(seen) == aggregates
    for positions in seen.values():
        assert positions == list(range(steps))


def test_sqlite_runs_one_relay_per_database_file(vendor):
    if vendor != "sqlite":
        # Elsewhere skip-locked claims let relays run side by side (tested above).
        assert connection.features.has_select_for_update_skip_locked
        return
    first = start_worker("record", "--max-seconds", "60")
    try:
        assert first.stdout.readline().strip() == "ready"
        second = start_worker("record", "--max-seconds", "5")
        _, err = second.communicate(timeout=60)
        assert second.returncode != 0
        assert "Another relay is already running on the SQLite database" in err
    finally:
        first.kill()
        first.communicate(timeout=10)
