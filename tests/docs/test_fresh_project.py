"""The docs' ``settings`` and ``python`` blocks as a user pastes them: in a
project started fresh (``django-admin startproject``, ``"outbox_app"`` added to
``INSTALLED_APPS``, ``migrate``), not in the test settings. A settings block is
appended to the project's settings.py and must pass ``manage.py check``; a
python block runs in ``manage.py shell`` on the project's own database."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import require_service
from tests.kit import manage
from tests.services import RABBITMQ_URL

from .blocks import ROOT, ids, manage_commands, section, tagged

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """A project as ``startproject`` makes it, with outbox_app installed and
    migrated; yields its directory, its settings file and their text."""
    root = tmp_path_factory.mktemp("fresh")
    settings = start_project(root)
    yield root, settings, settings.read_text()


@pytest.mark.parametrize("block", tagged("settings"), ids=ids(tagged("settings")))
def test_settings_block_in_a_fresh_project(project, block):
    root, settings, text = project
    settings.write_text(f"{text}\n{block.code}")
    try:
        checked = manage("check", "--fail-level", "ERROR", cwd=root, check=False)
    finally:
        settings.write_text(text)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.parametrize("block", tagged("python"), ids=ids(tagged("python")))
def test_python_block_in_a_fresh_project(project, block):
    root, _, _ = project
    ran = manage("shell", "-c", block.code, cwd=root, check=False)
    assert ran.returncode == 0, ran.stderr


def start_project(root: Path) -> Path:
    """A project as ``startproject`` makes it in ``root``, ``"outbox_app"``
    added to ``INSTALLED_APPS``, migrated; returns its settings file."""
    subprocess.run(
        [sys.executable, "-m", "django", "startproject", "freshproject", str(root)],
        check=True,
        cwd=ROOT,
    )
    settings = root / "freshproject" / "settings.py"
    settings.write_text(settings.read_text() + '\nINSTALLED_APPS += ["outbox_app"]\n')
    migrated = manage("migrate", "-v", "0", cwd=root, check=False)
    assert migrated.returncode == 0, migrated.stderr
    return settings


#: The tour's RabbitMQ, exchange and queue, as its blocks name them.
TOUR_URL = "amqp://guest:guest@127.0.0.1:5672//"
TOUR_EXCHANGE = "shop.events"


@pytest.mark.services("rabbitmq")
def test_the_tour_runs_in_order_in_one_new_project(tmp_path):
    """The README's five-minute tour as a reader follows it, block after block
    in one project started fresh: python blocks in ``manage.py shell``,
    settings appended to settings.py (and ``check``), ``relay`` run once
    (``--once``, as its comment says). Its first broker delivery must reach
    a queue (the publisher once sent to an exchange nothing was bound to:
    ``312 NO_ROUTE`` until DEAD), and each block must hold after the others
    (the first one's ``report.succeeded == 1`` did not once step 6 added a
    publisher). The RabbitMQ is the suite's (OUTBOX_TEST_RABBITMQ_URL), the
    exchange and queue names the test's own."""
    from kombu import Connection

    tour = section(ROOT / "README.md", "Five-minute tour")
    assert [block.tag for block in tour] == ["python", "commands", "settings", "tour"]
    require_service("rabbitmq")
    exchange = f"outbox-tour-{uuid.uuid4().hex[:8]}"

    def ours(code: str) -> str:
        return code.replace(TOUR_URL, RABBITMQ_URL).replace(TOUR_EXCHANGE, exchange)

    settings = start_project(tmp_path)
    try:
        for block in tour:
            code = ours(block.code)
            if block.tag in ("python", "tour"):
                ran = manage("shell", "-c", code, cwd=tmp_path, check=False)
                assert ran.returncode == 0, f"{block.id}:\n{ran.stdout}{ran.stderr}"
            elif block.tag == "settings":
                settings.write_text(f"{settings.read_text()}\n{code}")
                checked = manage(
                    "check", "--fail-level", "ERROR", cwd=tmp_path, check=False
                )
                assert checked.returncode == 0, f"{block.id}: {checked.stderr}"
            elif block.tag == "commands":
                for command, _ in manage_commands(code):
                    extra = ["--once"] if command == "relay" else []
                    ran = manage(command, *extra, cwd=tmp_path, check=False)
                    assert ran.returncode == 0, f"{block.id} {command}: {ran.stderr}"
    finally:
        with Connection(RABBITMQ_URL) as connection:
            channel = connection.channel()
            channel.queue_delete(f"{exchange}.all")
            channel.exchange_delete(exchange)
