"""Health probes: ``relay --health-file`` and ``manage.py outbox_health``."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from io import StringIO

import pytest
from django.core.management import call_command

from outbox_app.health import HealthFile, read_health
from tests.processes import ROOT, Watched, spawn, wait_for
from tests.relay.test_relay_command import place, relay_process


def probe(path, *args: str) -> tuple[int, str]:
    """``outbox_health --file PATH ARGS`` in this process: exit code, stderr."""
    err = StringIO()
    try:
        call_command("outbox_health", "--file", str(path), *args, stderr=err)
    except SystemExit as exc:
        return int(exc.code), err.getvalue()
    return 0, err.getvalue()


def test_outbox_health_reads_the_file(tmp_path):
    path = tmp_path / "health.json"
    code, err = probe(path)
    assert code == 1 and "no health file at" in err
    path.write_text("{not json")
    code, err = probe(path)
    assert code == 1 and "cannot be read" in err
    health = HealthFile(path)
    health.report(False, "database unreachable: gone")
    assert json.loads(path.read_text())["why"] == "database unreachable: gone"
    assert probe(path) == (0, "")  # alive, not ready
    code, err = probe(path, "--ready")
    assert (code, err.strip()) == (1, "not ready: database unreachable: gone")
    health.report(True, "ignored when ready")
    assert read_health(path).why == ""
    assert probe(path, "--ready") == (0, "")
    path.write_text(json.dumps({"alive_at": time.time() - 5, "ready": True}))
    code, err = probe(path, "--max-age", "2")
    assert code == 1 and "not alive: the last loop turn was 5" in err
    health.remove()
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary file left behind


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_frozen_relay_fails_liveness_and_passes_again_once_thawed(tmp_path):
    path = tmp_path / "relay.health"
    relay = Watched(
        relay_process("--health-file", str(path), OUTBOX_TEST_HANDLER_SETS="record")
    )
    try:
        wait_for(path.exists, 60, "the relay's first loop turn")
        assert probe(path, "--max-age", "2", "--ready") == (0, "")
        relay.process.send_signal(signal.SIGSTOP)
        try:
            time.sleep(3)
            code, err = probe(path, "--max-age", "2")
            assert code == 1 and "not alive" in err, err
            # The probe as Kubernetes runs it: a process, its exit code.
            command = subprocess.run(
                [
                    *(sys.executable, "manage.py", "outbox_health"),
                    *("--file", str(path), "--max-age", "2"),
                    "--settings=tests.settings",
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert command.returncode == 1, command.stderr
            assert "not alive: the last loop turn was" in command.stderr
        finally:
            relay.process.send_signal(signal.SIGCONT)
        wait_for(lambda: probe(path, "--max-age", "2")[0] == 0, 10, "liveness again")
        assert probe(path, "--max-age", "2", "--ready") == (0, "")
    finally:
        code = relay.stop()
    assert code == 0, relay.text()
    assert not path.exists()  # a clean stop removes it


@pytest.mark.django_db(transaction=True)
@pytest.mark.slow
def test_a_relay_whose_publisher_is_paused_is_alive_but_not_ready(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as free:
        port = free.getsockname()[1]  # closed once the block ends: refused
    publishers = {
        "bus": {
            "URL": f"amqp://guest:guest@127.0.0.1:{port}//",
            "EXCHANGE": "outbox-health",
            "CONNECT_RETRIES": 0,
        }
    }
    path = tmp_path / "relay.health"
    place(1)
    relay = Watched(
        spawn(
            "manage.py",
            "relay",
            "--settings=tests.settings",
            "--only",
            "publishers",
            "--health-file",
            str(path),
            OUTBOX_TEST_PUBLISHERS=json.dumps(publishers),
        )
    )
    try:
        wait_for(
            lambda: probe(path, "--ready")[0] == 1 and path.exists(),
            60,
            "the publisher to pause",
        )
        code, err = probe(path, "--ready", "--max-age", "2")
        assert code == 1, err
        assert "not ready: publisher bus paused:" in err, err
        assert probe(path, "--max-age", "2") == (0, "")  # alive all the same
    finally:
        code = relay.stop()
    assert code == 0, relay.text()


def test_health_file_in_a_missing_directory_is_refused(tmp_path):
    from django.core.management.base import CommandError

    with pytest.raises(CommandError, match="--health-file: the directory"):
        call_command(
            "relay", "--once", "--health-file", str(tmp_path / "no" / "health")
        )
