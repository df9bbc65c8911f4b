"""The health file of a long-running process (``relay``, ``consume``
``--health-file``) and its reading (``manage.py outbox_health``): probes an
orchestrator runs without a port.

The process rewrites the file at every turn of its loop (at most once a
second while nothing changes, at once when readiness changes, and every
second while it waits to reconnect), atomically (a temporary file in the same
directory, then ``os.replace``), with one JSON object::

    {"alive_at": 1764115200.25, "ready": true, "why": ""}

``alive_at``: the wall clock (seconds since the epoch) of the last turn;
``ready``: the database answered on the last turn and (``relay``) no
publisher is paused, (``consume``) the broker is connected; ``why``: what
keeps it from being ready, empty when ready. A process that stops cleanly
removes its file. Writing costs no database query.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from .exceptions import HealthFileUnreadable

logger = logging.getLogger("outbox_app.health")

#: Seconds between rewrites of an unchanged health file.
REFRESH_SECONDS = 1.0
#: ``outbox_health``'s default ``--max-age``, in seconds.
MAX_AGE_SECONDS = 30.0


class HealthFile:
    """The health file a process writes.

    Args:
        path: where to write it; its directory must exist and be writable.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self.ready = False
        self.why = "starting"
        self._written_at: float | None = None
        self._failed = False

    def report(self, ready: bool, why: str = "") -> None:
        """One loop turn: record readiness (``why``: what keeps it from being
        ready, ignored when ready) and rewrite the file when it changed or
        ``REFRESH_SECONDS`` passed."""
        why = "" if ready else why
        changed = (ready, why) != (self.ready, self.why)
        self.ready, self.why = ready, why
        now = time.monotonic()
        if (
            changed
            or self._written_at is None
            or now - self._written_at >= REFRESH_SECONDS
        ):
            self._write()
            self._written_at = now

    def wait(self, stop: threading.Event, seconds: float) -> bool:
        """Wait up to ``seconds`` for ``stop`` (a reconnect's backoff), alive
        meanwhile: the file is rewritten every ``REFRESH_SECONDS``. Returns
        whether ``stop`` was set."""
        deadline = time.monotonic() + seconds
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return stop.is_set()
            if stop.wait(min(remaining, REFRESH_SECONDS)):
                return True
            self.report(self.ready, self.why)

    def remove(self) -> None:
        """Remove the file (a clean stop): no probe takes a stopped process
        for a live one."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.warning("cannot remove the health file %s: %s", self.path, exc)

    def _write(self) -> None:
        body = json.dumps(
            {"alive_at": round(time.time(), 3), "ready": self.ready, "why": self.why}
        )
        try:
            fd, temporary = tempfile.mkstemp(
                dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp"
            )
            try:
                with os.fdopen(fd, "w") as file:
                    file.write(body)
                os.replace(temporary, self.path)
            except BaseException:
                Path(temporary).unlink(missing_ok=True)
                raise
        except OSError as exc:
            # Logged once per failing streak: the probe fails, which says it.
            if not self._failed:
                logger.error("cannot write the health file %s: %s", self.path, exc)
            self._failed = True
            return
        self._failed = False


@dataclass(frozen=True)
class Health:
    """What a health file says.

    Attributes:
        alive_at: the process's last loop turn, seconds since the epoch.
        ready: whether it was ready then.
        why: what kept it from being ready (empty when ready).
    """

    alive_at: float
    ready: bool
    why: str

    def problem(self, max_age: float, ready: bool, now: float | None = None) -> str:
        """Why a probe fails: the last turn is more than ``max_age`` seconds
        old, or (``ready``) the process is not ready; empty when it passes."""
        age = (time.time() if now is None else now) - self.alive_at
        if age > max_age:
            return (
                f"not alive: the last loop turn was {age:.1f} s ago "
                f"(more than {max_age:g} s)"
            )
        if ready and not self.ready:
            return f"not ready: {self.why or 'no reason given'}"
        return ""


def read_health(path: str | os.PathLike[str]) -> Health:
    """Read a health file.

    Raises:
        HealthFileUnreadable: the file is missing (the process never turned
            its loop, or stopped), unreadable, or not a health file's JSON.
    """
    try:
        data = json.loads(Path(path).read_text())
        return Health(
            alive_at=float(data["alive_at"]),
            ready=bool(data["ready"]),
            why=str(data.get("why", "")),
        )
    except FileNotFoundError:
        raise HealthFileUnreadable(
            f"no health file at {path}: the process has not started its loop "
            "or has stopped"
        ) from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise HealthFileUnreadable(
            f"the health file {path} cannot be read: {exc!r}"
        ) from exc
