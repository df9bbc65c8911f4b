"""The outputs the pages show are the ones the commands print: the README's
``simulate`` run and ``outbox_status``'s table and JSON in docs/operations.md,
compared with a real run line by line (words, not numbers) and key by key,
both ways: a row or a key the command prints and the page lacks fails too
(a ``catalog`` row and five JSON keys once went missing)."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import subprocess
import sys
import uuid

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from outbox_app import InboxMessage
from outbox_app.models import Subscription
from outbox_app.store.lifecycle import InboxState, State
from outbox_app.subscribers import Handler
from tests.ops.factories import delivery, events, subscribed

from .blocks import ROOT, blocks, tagged
from .ci import _shape, _shown_output

OPERATIONS = ROOT / "docs" / "operations.md"


def _shapes(text: str) -> set[tuple[str, ...]]:
    return {_shape(line) for line in re.split(r"[\r\n]+", text)} - {()}


@pytest.mark.slow
def test_the_readme_shows_what_simulate_prints(tmp_path):
    [setup] = [b for b in tagged("ci") if "simulate --orders 300" in b.code]
    shown = _shown_output(setup)
    assert shown is not None, f"{setup.id} has no output block after it"
    env = {
        **{
            key: value
            for key, value in os.environ.items()
            if not key.startswith(("OUTBOX_", "CELERY_", "SHOP_", "DATABASE_"))
        },
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": f"sqlite:///{tmp_path}/db.sqlite3",
    }
    for args in (["migrate", "-v", "0"], ["simulate", "--orders", "300"]):
        ran = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 0, ran.stdout + ran.stderr
    printed, page = _shapes(ran.stdout), _shapes(shown.code)
    assert page - printed == set(), "shown, not printed"
    assert printed - page == set(), "printed, not shown"


def _console(heading_command: str) -> str:
    """The output of the docs' ``$ python manage.py <heading_command>`` block
    (its first line is the command)."""
    for block in blocks(OPERATIONS):
        first, _, rest = block.code.partition("\n")
        if first == f"$ python manage.py {heading_command}":
            return rest
    raise AssertionError(f"no block runs {heading_command!r}")


def _keys(value, path: str = "") -> set[str]:
    """Every key path of a JSON value, a list's by all its items."""
    if isinstance(value, dict):
        return {f"{path}.{key}" for key in value} | {
            k for key, item in value.items() for k in _keys(item, f"{path}.{key}")
        }
    if isinstance(value, list):
        return {k for item in value for k in _keys(item, f"{path}[]")}
    return set()


@pytest.mark.django_db
@pytest.mark.any_database
def test_outbox_status_json_shows_the_keys_it_prints():
    shown = _console("outbox_status --json --max-dead 0")
    shown = json.loads(re.sub(r",\s*\.\.\.", "", shown))  # the shortened series
    delivery(events(1)[0], "ops.record", State.DEAD)
    # What the page shows besides: a subscription no relay serves now (a
    # former version's) and a consumer's inbox.
    now = timezone.now()
    Subscription.objects.record(
        [Handler(name="ops.legacy", event_types=frozenset({"OrderPlaced"}))],
        "relay:1717",
        now - datetime.timedelta(hours=3),
    )
    InboxMessage.objects.create(
        consumer="ops.consumed",
        message_id=str(uuid.uuid4()),
        queue="ops",
        event_type="OrderPlaced",
        state=InboxState.HANDLED,
        received_at=now,
        handled_at=now,
    )
    out = io.StringIO()
    with subscribed("OrderPlaced"), pytest.raises(CommandError):
        call_command("outbox_status", "--json", "--max-dead", "0", stdout=out)
    printed = json.loads(out.getvalue())
    assert _keys(shown) == _keys(printed)
    assert set(shown["states"]) == set(printed["states"])
    assert set(shown["subscribers"][0]["states"]) == set(State.values)


@pytest.mark.django_db
@pytest.mark.any_database
def test_outbox_status_table_shows_its_columns_and_lines():
    shown = _console("outbox_status")
    delivery(events(1)[0], "ops.record", State.DEAD)
    out = io.StringIO()
    with subscribed("OrderPlaced"):
        call_command("outbox_status", stdout=out, no_color=True)
    printed = out.getvalue().splitlines()
    assert shown.splitlines()[0].split() == printed[0].split()  # the columns
    assert _labels(printed) == _labels(shown.splitlines())


def _labels(lines: list[str]) -> set[str]:
    """The labels of the summary lines (``stream <subscriber>``: ``stream``)."""
    return {
        "stream" if label.startswith("stream ") else label
        for label in (line.split(":")[0] for line in lines if ":" in line)
    }
