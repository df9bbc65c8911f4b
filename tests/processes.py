"""Start relay processes against the test database."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from django.db import connection

ROOT = Path(__file__).resolve().parents[1]


def database_url() -> str:
    """The URL of the database the tests run on (the test database)."""
    db = connection.settings_dict
    if connection.vendor == "sqlite":
        return f"sqlite:///{db['NAME']}"
    scheme = {"postgresql": "postgres", "mysql": "mysql"}[connection.vendor]
    auth = db["USER"] + (f":{db['PASSWORD']}" if db["PASSWORD"] else "")
    return f"{scheme}://{auth}@{db['HOST']}:{db['PORT']}/{db['NAME']}"


def spawn(*args: str, stderr=subprocess.PIPE, **env: str) -> subprocess.Popen:
    """Run ``python *args`` in the repository with the tests' settings and DB."""
    environment = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        **env,
    }
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=environment,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
