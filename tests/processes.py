"""Start relay processes against the test database."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from django.conf import settings
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


def spawn(
    *args: str, stderr=subprocess.PIPE, clock: str | None = None, **env: str
) -> subprocess.Popen:
    """Run ``python *args`` in the repository with the tests' settings and DB.

    ``clock``: run it under libfaketime (the ``faketime`` package) with its
    wall clock moved by this offset (``"+90s"``, ``"-90s"``: ``FAKETIME``'s
    format). Its monotonic clock stays true and ``time.sleep()`` goes through
    ``select()`` (``tests/faketime/sitecustomize.py``): libfaketime's own
    monotonic clock hangs timed lock waits, and its sleep fails with EINVAL
    once the monotonic clock is left alone.
    """
    environment = {
        **os.environ,
        "DATABASE_URL": database_url(),
        "DJANGO_SETTINGS_MODULE": "tests.settings",
        # The engine this test runs on (an engine mark overrides the suite's).
        "OUTBOX_TEST_ENGINE": settings.OUTBOX_ENGINE or "",
        **env,
    }
    command = [sys.executable, *args]
    if clock is not None:
        faked = str(ROOT / "tests" / "faketime")
        path = environment.get("PYTHONPATH")
        environment["PYTHONPATH"] = f"{faked}:{path}" if path else faked
        # What the faketime command sets, with the process itself exec'ed (the
        # command forks and waits: a signal to it would miss the relay).
        environment["LD_PRELOAD"] = "/usr/$LIB/faketime/libfaketimeMT.so.1"
        environment["FAKETIME"] = clock
        environment["FAKETIME_DONT_FAKE_MONOTONIC"] = "1"
    return subprocess.Popen(
        command,
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


class Watched:
    """A spawned process whose stderr lines are collected by a thread, so it
    never blocks on a full pipe; :meth:`stop` ends it and closes its pipes."""

    def __init__(self, process: subprocess.Popen):
        self.process = process
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def has(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in self.lines)

    def text(self) -> str:
        return "".join(self.lines)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        """Send ``sig`` (if still running), wait, close the pipes; the exit code."""
        process = self.process
        if process.poll() is None:
            process.send_signal(sig)
        try:
            process.wait(timeout)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            self._reader.join(10)
            process.stdout.close()
            process.stderr.close()
        return process.returncode


def celery_worker(*args: str, **env: str) -> Watched:
    """A Celery worker of ``tests/celery_app.py`` (solo pool) with ``args``
    and ``env``, once it is ready; the test fails if it exits at start."""
    import pytest

    process = spawn(
        "-m",
        "celery",
        "-A",
        "tests.celery_app",
        "worker",
        # A node name of its own: the default (celery@host) shares its
        # exclusive pidbox queue with every other worker on this machine and
        # broker (another suite's, the docs job's), which stops it at start.
        "--hostname",
        f"outbox-tests-{uuid.uuid4().hex[:8]}@%h",
        "--pool",
        "solo",
        "--loglevel",
        "INFO",
        *args,
        **env,
    )
    worker = Watched(process)
    wait_for(
        lambda: worker.has(r"ready\.") or process.poll() is not None,
        60,
        "the Celery worker",
    )
    if process.poll() is not None:
        worker.stop()  # its pipes closed: no ResourceWarning in a later test
        pytest.fail(f"the Celery worker exited at start:\n{worker.text()}")
    return worker


def publisher_relay(publishers: dict, batch_size: int, **env: str) -> Watched:
    """``manage.py relay --only publishers`` in its own process, its
    ``OUTBOX_PUBLISHERS`` set to ``publishers``."""
    return Watched(
        spawn(
            "manage.py",
            "relay",
            "--settings=tests.settings",
            "--only",
            "publishers",
            "--batch-size",
            str(batch_size),
            OUTBOX_TEST_PUBLISHERS=json.dumps(publishers),
            **env,
        )
    )


def kill_other_connections() -> int:
    """Close every other session on the test database, as a database restart
    or a network cut would (PostgreSQL: ``pg_terminate_backend``; MariaDB:
    ``KILL``; SQLite has none). Returns how many."""
    vendor = connection.vendor
    name = connection.settings_dict["NAME"]
    with connection.cursor() as cursor:
        if vendor == "postgresql":
            cursor.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE datname = %s AND pid <> pg_backend_pid()",
                [name],
            )
            return len(cursor.fetchall())
        if vendor == "mysql":
            cursor.execute(
                "SELECT id FROM information_schema.processlist "
                "WHERE db = %s AND id <> CONNECTION_ID()",
                [name],
            )
            ids = [row[0] for row in cursor.fetchall()]
            for pid in ids:
                cursor.execute(f"KILL {int(pid)}")
            return len(ids)
    return 0


def loopback_only(port: int, timeout: float = 60) -> bool:
    """Once something listens on 127.0.0.1:``port``: whether it listens on
    that address alone. 127.0.0.2 is loopback too (Linux routes all of
    127/8), so a server bound to every interface accepts it, and one bound
    to 127.0.0.1 refuses it."""
    from tests.services import port_open

    wait_for(lambda: port_open(("127.0.0.1", port)), timeout, f"port {port}")
    return not port_open(("127.0.0.2", port))
