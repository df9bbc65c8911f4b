"""outbox_app's commands piped into a reader that goes away (``outbox_status |
head``): they stop quietly, with the status a process killed by SIGPIPE has,
and no BrokenPipeError traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from outbox_app.management.base import BROKEN_PIPE

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def project_env(tmp_path_factory) -> dict[str, str]:
    """The sample project on a migrated SQLite file of its own."""
    directory = tmp_path_factory.mktemp("pipe")
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")},
        "DJANGO_SETTINGS_MODULE": "sample_project.settings",
        "DATABASE_URL": f"sqlite:///{directory}/db.sqlite3",
    }
    subprocess.run(
        [sys.executable, "manage.py", "migrate", "-v", "0"],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=120,
    )
    return env


@pytest.mark.parametrize(
    "args",
    [
        ["outbox_status"],
        ["outbox_status", "--json"],
        ["outbox_status", "--format", "prometheus"],
        ["outbox_subscribers"],
        ["outbox_subscribers", "--record"],
        ["outbox_purge", "--dry-run"],
    ],
    ids=" ".join,
)
def test_a_reader_that_went_away_ends_the_command_quietly(project_env, args):
    read, write = os.pipe()
    os.close(read)  # the reader has gone: every write fails (EPIPE)
    try:
        done = subprocess.run(
            [sys.executable, "manage.py", *args],
            cwd=ROOT,
            env=project_env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
    assert "Traceback" not in done.stderr and "BrokenPipe" not in done.stderr, (
        done.stderr
    )
    assert done.returncode == BROKEN_PIPE, done.stderr
