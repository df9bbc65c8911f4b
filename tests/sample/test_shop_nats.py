"""The sample shop publishing to NATS JetStream too (``SHOP_NATS_URL``), in
subprocesses against the machine's nats-server: ``simulate`` reconciles with
the second publisher and the stream holds exactly one message per committed
event; and after a relay SIGKILLed between JetStream's PubAcks and marking the
rows, the second relay's resend leaves it that way (``Nats-Msg-Id``).

The result does not depend on the database, so these tests run in the SQLite
pass only (not marked, tests/conftest.py deselects them on PostgreSQL and
MariaDB), the shop on a SQLite file of its own. Each test uses its own stream
and subjects, read back with an independent nats-py client, and deletes the
stream afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid

import pytest

from tests.conftest import require_service
from tests.sample.test_sample_project import _manage
from tests.services import NATS_URL

pytestmark = pytest.mark.services("nats")

#: The killed relay's rows are sent again once this lease (seconds) ran out.
LEASE = 2


def _stream(work):
    """``await work(js)`` on a nats-py connection of its own."""

    async def session():
        import nats

        client = await nats.connect(NATS_URL)
        try:
            return await work(client.jetstream())
        finally:
            await client.close()

    return asyncio.run(session())


def stored_ids(name: str) -> list[str]:
    """The event id of every message in stream ``name`` (the last part of its
    ``Nats-Msg-Id``, ``<namespace>:<publisher>:<event id>``), in stream
    order."""

    async def read(js):
        state = (await js.stream_info(name)).state
        if not state.messages:
            return []
        return [
            (await js.get_msg(name, seq)).headers["Nats-Msg-Id"].rpartition(":")[2]
            for seq in range(state.first_seq, state.last_seq + 1)
        ]

    return _stream(read)


@pytest.fixture
def shop(tmp_path):
    """Environment for the shop on a fresh, migrated SQLite file, publishing to
    a stream and subjects of its own besides memory://; the stream is deleted
    afterwards."""
    require_service("nats")
    unique = uuid.uuid4().hex[:12]
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path / 'shop.sqlite3'}",
        "OUTBOX_BROKER_URL": "memory://",
        "SHOP_EVENTS_EXCHANGE": f"shop.events.test{unique}",
        "SHOP_NATS_URL": NATS_URL,
        "SHOP_NATS_STREAM": f"SHOP_TEST_{unique}",
        "SHOP_NATS_SUBJECT_PREFIX": f"shoptest{unique}",
        "OUTBOX_LEASE_SECONDS": str(LEASE),
    }
    _manage(env, "migrate", "-v0")
    yield env
    with contextlib.suppress(Exception):  # never created: the test failed early
        _stream(lambda js: js.delete_stream(env["SHOP_NATS_STREAM"]))


def outbox(env: dict) -> dict:
    """The committed event ids and the state of each one's "nats" delivery,
    as an operator sees it."""
    script = (
        "import json; from outbox_app import OutboxEvent; "
        "from outbox_app.ops.streams import event_deliveries; "
        "events = OutboxEvent.objects.exclude(event_type=None); "
        "print(json.dumps({'events': [str(e.id) for e in events], "
        "'nats': [event_deliveries(e).get('nats') for e in events]}))"
    )
    return json.loads(_manage(env, "shell", "-c", script).stdout.splitlines()[-1])


def test_simulate_stores_each_committed_event_once(shop):
    result = _manage(shop, "simulate", "--orders", "200", check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "reconciliation: OK" in result.stdout
    committed = outbox(shop)["events"]
    report = next(
        line for line in result.stdout.splitlines() if line.startswith("nats: ")
    )
    assert f"delivered {len(committed)} of {len(committed)} committed" in report
    assert len(committed) > 200  # orders, payments, deposits, ...
    stored = stored_ids(shop["SHOP_NATS_STREAM"])
    assert len(stored) == len(committed)
    assert sorted(stored) == sorted(committed)


def test_sigkill_between_pub_ack_and_mark__the_stream_still_holds_each_event_once(
    shop, tmp_path
):
    """The relay dies after JetStream acked its first batch and before the rows
    were marked; after the lease a second relay sends those rows again, and the
    stream drops them as duplicates."""
    _manage(
        shop,
        "shell",
        "-c",
        "from decimal import Decimal; from sample_project.shop import services\n"
        "for i in range(40):\n"
        "    services.place_order(f'c{i}@example.com', Decimal(10 + i), 'mug')",
    )
    # The shop's settings with the tests' KillingJetStreamPublisher (it
    # SIGKILLs its process at OUTBOX_TEST_KILL_AT) as the "nats" backend.
    (tmp_path / "killing_shop_settings.py").write_text(
        "from sample_project.settings import *  # noqa: F403\n\n"
        'OUTBOX_PUBLISHERS["nats"]["BACKEND"] = '
        '"tests.testapp.publishers.KillingJetStreamPublisher"\n'
    )
    killing = {
        **shop,
        "DJANGO_SETTINGS_MODULE": "killing_shop_settings",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])
        ),
        "OUTBOX_TEST_KILL_AT": "collect:1:after",  # acked, not marked
    }
    killed = _manage(
        killing, "relay", "--only", "publishers", "--batch-size", "8", check=False
    )
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    killed_at = time.monotonic()
    stream = shop["SHOP_NATS_STREAM"]
    first = stored_ids(stream)
    assert 0 < len(first) < 40
    assert "SUCCEEDED" not in outbox(shop)["nats"]

    time.sleep(max(LEASE + 0.5 - (time.monotonic() - killed_at), 0))
    relay = _manage(shop, "relay", "--once")
    assert "dead 0" in relay.stdout, relay.stdout + relay.stderr
    state = outbox(shop)
    assert set(state["nats"]) == {"SUCCEEDED"}
    stored = stored_ids(stream)
    assert len(stored) == len(state["events"]) == 40
    assert sorted(stored) == sorted(state["events"])  # once each
    assert stored[: len(first)] == first  # sent twice, stored once
