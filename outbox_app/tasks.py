"""Celery tasks running the relay.

Add the tasks to beat with :func:`beat_schedule`::

    # celery.py of your project
    from outbox_app.tasks import beat_schedule

    app.conf.beat_schedule = {**app.conf.beat_schedule, **beat_schedule()}

Every task is time-boxed (``max_seconds``) and each beat entry expires after its
interval, so runs never pile up; two overlapping runs are safe because claims
skip each other's rows. On SQLite a run finding another relay at work on the
database file returns at once (``{"skipped": ...}``).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
from typing import Any

from celery import shared_task
from django.core.exceptions import ImproperlyConfigured

from .conf import mask_url, outbox_settings
from .exceptions import RelayAlreadyRunning
from .publishers.celery import celery_app
from .relay.registry import handlers, publishers

RELAY_EVENTS = "outbox_app.relay_events"
RUN_HANDLERS = "outbox_app.run_handlers"
PURGE_OUTBOX = "outbox_app.purge_outbox"

logger = logging.getLogger("outbox_app.tasks")


#: Seconds between beat's relay runs by default: with ``OUTBOX_CELERY_WAKE``
#: every commit wakes the relay at once and beat is only the safety net.
WAKE_INTERVAL = 10.0
#: Without the wake-up, beat's interval is the delivery latency.
POLL_INTERVAL = 1.0


def _relay(
    task, kind: str, using: str, max_seconds: float, batch_size: int | None
) -> dict:
    # Imported here so a project's celery.py can import this module (for
    # beat_schedule) before Django's app registry is ready.
    from .relay import relay_once
    from .relay.worker import single_relay_guard

    began = time.monotonic()
    try:
        with single_relay_guard(using):
            report = relay_once(
                kind=kind, using=using, max_seconds=max_seconds, batch_size=batch_size
            )
    except RelayAlreadyRunning as exc:
        return {"skipped": str(exc)}
    result: dict[str, Any] = report.as_dict()
    if report.claimed and time.monotonic() - began >= 0.9 * max_seconds:
        # Out of time with a backlog: the next run starts now, not at the next
        # beat (which may be seconds away: beat is the safety net, not a loop).
        task.apply_async(
            kwargs={
                "using": using,
                "max_seconds": max_seconds,
                "batch_size": batch_size,
            },
            expires=max(30.0, 3 * max_seconds),
        )
        result["continued"] = True
    return result


@shared_task(name=RELAY_EVENTS, ignore_result=True, bind=True)
def relay_events(
    self,
    using: str = "default",
    max_seconds: float = 10.0,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Fan out, then deliver due deliveries to the broker publishers. A run
    that ends out of time with work left enqueues the next one at once.

    Args:
        using: database alias.
        max_seconds: time budget in seconds.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.

    Returns:
        The RelayReport as a dict (``"continued": True`` when it enqueued the
        next run), or ``{"skipped": reason}``.
    """
    return _relay(self, "publisher", using, max_seconds, batch_size)


@shared_task(name=RUN_HANDLERS, ignore_result=True, bind=True)
def run_handlers(
    self,
    using: str = "default",
    max_seconds: float = 10.0,
    batch_size: int | None = None,
) -> dict[str, Any]:
    """Fan out, then run due deliveries of the in-process handlers (in the
    Celery worker's process). Same arguments and result as :func:`relay_events`."""
    return _relay(self, "handler", using, max_seconds, batch_size)


@shared_task(name=PURGE_OUTBOX, ignore_result=True)
def purge_outbox(
    older_than_days: int | None = None, using: str = "default"
) -> dict[str, Any]:
    """Delete finished rows older than ``OUTBOX_RETENTION_DAYS`` (or
    ``older_than_days``) from the outbox of database ``using``, as ``manage.py
    outbox_purge --database`` does."""
    from .ops.purge import purge

    return purge(older_than_days=older_than_days, using=using).as_dict()


def beat_schedule(
    interval: float | None = None,
    purge_every: float = 3600.0,
    using: str = "default",
) -> dict[str, dict[str, Any]]:
    """A ready ``beat_schedule`` fragment for the three tasks.

    Args:
        interval: seconds between relay runs (``relay_events`` and
            ``run_handlers``); each run is time-boxed to it and expires after it.
            Default: :data:`WAKE_INTERVAL` (10) when ``OUTBOX_CELERY_WAKE`` is
            on (commits wake the relay; beat only catches what a lost wake-up
            missed, and an idle worker logs a few lines every 10 s, not every
            second), else :data:`POLL_INTERVAL` (1: beat is the latency).
        purge_every: seconds between purges.
        using: database alias. With several databases (one outbox each), merge
            one fragment per alias: the names of an alias other than
            ``default`` end with ``-<alias>`` (``outbox-relay-events-shard2``).

    Returns:
        ``{entry name: {"task", "schedule", "kwargs", "options"}}``.
    """
    if interval is None:
        try:
            waking = outbox_settings.CELERY_WAKE is True
        except ImproperlyConfigured:  # DJANGO_SETTINGS_MODULE not set yet
            waking = False
        interval = WAKE_INTERVAL if waking else POLL_INTERVAL
    relay_kwargs = {"using": using, "max_seconds": max(interval * 0.9, 0.5)}
    suffix = "" if using == "default" else f"-{using}"
    entries = {
        "outbox-relay-events": {
            "task": RELAY_EVENTS,
            "schedule": interval,
            "kwargs": relay_kwargs,
            "options": {"expires": interval},
        },
        "outbox-run-handlers": {
            "task": RUN_HANDLERS,
            "schedule": interval,
            "kwargs": relay_kwargs,
            "options": {"expires": interval},
        },
        "outbox-purge": {
            "task": PURGE_OUTBOX,
            "schedule": purge_every,
            "kwargs": {"using": using},
            "options": {"expires": purge_every},
        },
    }
    return {f"{name}{suffix}": entry for name, entry in entries.items()}


class Waker:
    """Sends the wake-up tasks from one daemon thread per process, so a commit
    never waits on the broker.

    ``wake()`` only marks the database alias due and returns: no I/O in the
    committing thread, whatever the broker does. The thread sends
    ``relay_events`` and/or ``run_handlers`` with ``send_task(retry=False)``
    (bounded by Celery's ``broker_connection_timeout``); wake-ups arriving
    while a send is in flight coalesce into one more send. A broker outage is
    logged once, as a warning, and its end once: a wake-up is best effort,
    beat is what guarantees delivery (docs/celery.md).
    """

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._due: set[str] = set()
        self._sending = False
        self._pid: int | None = None
        self._failing = False

    def wake(self, using: str) -> None:
        with self._changed:
            if self._pid != os.getpid():  # first use, or a forked child
                self._pid, self._due, self._sending = os.getpid(), set(), False
                threading.Thread(
                    target=self._run, name="outbox-celery-wake", daemon=True
                ).start()
            self._due.add(using)
            self._changed.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the due wake-ups to be sent (or to
        fail); True when none is left. Runs at interpreter exit, so a short
        process (a management command) does not drop its last wake-up."""
        with self._changed:
            return self._changed.wait_for(
                lambda: self._pid != os.getpid() or not (self._due or self._sending),
                timeout,
            )

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._due)
                due, self._due, self._sending = self._due, set(), True
            try:
                for using in sorted(due):
                    self._send(using)
            finally:
                with self._changed:
                    self._sending = False
                    self._changed.notify_all()

    def _send(self, using: str) -> None:
        names = ([RELAY_EVENTS] if publishers() else []) + (
            [RUN_HANDLERS] if handlers() else []
        )
        try:
            app = celery_app()
            for name in names:
                app.send_task(name, kwargs={"using": using}, expires=30, retry=False)
        except Exception as exc:  # best effort: beat delivers
            if not self._failing:
                self._failing = True
                logger.warning(
                    "outbox wake-up not sent (%s: %s); the beat schedule delivers "
                    "the events. Logged once until a wake-up is sent again.",
                    type(exc).__name__,
                    mask_url(str(exc)),
                )
            return
        if self._failing:
            self._failing = False
            logger.warning("outbox wake-ups are sent again")


_waker = Waker()


def flush_wakeups(timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for the wake-ups this process marked
    due (:func:`wake`) to be sent, or to fail; True when none is left. Runs at
    interpreter exit with 2 seconds, so a short process (a management command)
    does not drop its last wake-up."""
    return _waker.flush(timeout)


atexit.register(flush_wakeups, 2.0)


def wake(using: str) -> None:
    """Enqueue a relay run now (``OUTBOX_CELERY_WAKE``), called after a commit
    that published events: ``relay_events`` when publishers are configured,
    ``run_handlers`` when handlers are registered. Returns at once; the tasks
    are sent by :class:`Waker`'s thread."""
    _waker.wake(using)
