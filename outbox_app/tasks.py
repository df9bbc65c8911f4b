"""Celery tasks running the relay; the only module that imports Celery.

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

from typing import Any

from celery import shared_task

from .db import single_relay_guard
from .exceptions import RelayAlreadyRunning
from .registry import handlers, publishers

RELAY_EVENTS = "outbox_app.relay_events"
RUN_HANDLERS = "outbox_app.run_handlers"
PURGE_OUTBOX = "outbox_app.purge_outbox"


def _relay(kind: str, using: str, max_seconds: float, batch_size: int | None) -> dict:
    # Imported here so a project's celery.py can import this module (for
    # beat_schedule) before Django's app registry is ready.
    from .delivery import relay_once

    try:
        with single_relay_guard(using):
            return relay_once(
                kind=kind, using=using, max_seconds=max_seconds, batch_size=batch_size
            ).as_dict()
    except RelayAlreadyRunning as exc:
        return {"skipped": str(exc)}


@shared_task(name=RELAY_EVENTS, ignore_result=True)
def relay_events(
    using: str = "default", max_seconds: float = 10.0, batch_size: int | None = None
) -> dict[str, Any]:
    """Fan out, then deliver due notifications to the broker publishers.

    Args:
        using: database alias.
        max_seconds: time budget in seconds.
        batch_size: rows per claim; default ``OUTBOX_BATCH_SIZE``.

    Returns:
        The RelayReport as a dict, or ``{"skipped": reason}``.
    """
    return _relay("publisher", using, max_seconds, batch_size)


@shared_task(name=RUN_HANDLERS, ignore_result=True)
def run_handlers(
    using: str = "default", max_seconds: float = 10.0, batch_size: int | None = None
) -> dict[str, Any]:
    """Fan out, then run due notifications of the in-process handlers (in the
    Celery worker's process). Same arguments and result as :func:`relay_events`."""
    return _relay("handler", using, max_seconds, batch_size)


@shared_task(name=PURGE_OUTBOX, ignore_result=True)
def purge_outbox(older_than_days: int | None = None) -> dict[str, Any]:
    """Delete finished rows older than ``OUTBOX_RETENTION_DAYS`` (or
    ``older_than_days``), as ``manage.py outbox_purge`` does."""
    from .purge import purge

    return purge(older_than_days=older_than_days).as_dict()


def beat_schedule(
    interval: float = 1.0, purge_every: float = 3600.0, using: str = "default"
) -> dict[str, dict[str, Any]]:
    """A ready ``beat_schedule`` fragment for the three tasks.

    Args:
        interval: seconds between relay runs (``relay_events`` and
            ``run_handlers``); each run is time-boxed to it and expires after it.
        purge_every: seconds between purges.
        using: database alias.

    Returns:
        ``{entry name: {"task", "schedule", "kwargs", "options"}}``.
    """
    relay_kwargs = {"using": using, "max_seconds": max(interval * 0.9, 0.5)}
    return {
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
            "options": {"expires": purge_every},
        },
    }


def wake(using: str) -> None:
    """Enqueue a relay run now (``OUTBOX_CELERY_WAKE``), called after a commit
    that published events: ``relay_events`` when publishers are configured,
    ``run_handlers`` when handlers are registered."""
    if publishers():
        relay_events.apply_async(kwargs={"using": using}, expires=30)
    if handlers():
        run_handlers.apply_async(kwargs={"using": using}, expires=30)
