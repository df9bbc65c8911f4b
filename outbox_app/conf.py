"""Every ``OUTBOX_*`` setting, its default, and its meaning.

Settings are read when accessed (never at import time), so ``override_settings``
works in tests. ``docs/settings.md`` lists the same table; ``checks.py``
validates each value with ``outbox.E001``-``outbox.E0xx``.

Usage::

    from outbox_app.conf import outbox_settings
    outbox_settings.MAX_ATTEMPTS
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.conf import settings


@dataclass(frozen=True)
class Setting:
    default: Any
    doc: str


DEFAULTS: dict[str, Setting] = {
    "NAMESPACE": Setting(
        "default",
        "Service identifier stamped on every outbox event (CloudEvents `source`).",
    ),
    "MAX_PAYLOAD_BYTES": Setting(
        1024 * 1024, "Largest encoded payload publish() accepts, in bytes."
    ),
    "MAX_ATTEMPTS": Setting(
        10, "Delivery attempts per notification before it is EXPIRED."
    ),
    "RETRY_BASE_SECONDS": Setting(
        1.0, "First backoff ceiling in seconds; doubles with each attempt."
    ),
    "RETRY_MAX_SECONDS": Setting(600.0, "Largest backoff ceiling, in seconds."),
    "LEASE_SECONDS": Setting(
        60.0,
        "How long a claimed notification stays leased to one worker, in seconds.",
    ),
    "BATCH_SIZE": Setting(
        500,
        "Rows claimed per batch by fan-out and delivery (chosen by measurement: "
        "docs/settings.md).",
    ),
    "POLL_INTERVAL": Setting(
        1.0, "Longest idle wait of the relay loop between polls, in seconds."
    ),
    "PAUSE_MAX_SECONDS": Setting(
        30.0,
        "Longest wait between probes of a publisher paused by an outage of its "
        "destination, in seconds.",
    ),
    "RETENTION_DAYS": Setting(
        30, "Finished rows older than this many days may be purged."
    ),
    "PUBLISHERS": Setting(
        {}, "Broker destinations: name -> options (see docs/brokers.md)."
    ),
    "CELERY_WAKE": Setting(
        False, "Enqueue the Celery relay_events task when a transaction commits."
    ),
    "TRACEBACK_MAX_CHARS": Setting(
        8000, "Longest traceback kept on a failed notification, in characters."
    ),
}


class OutboxSettings:
    """Attribute access to ``settings.OUTBOX_<NAME>`` with the defaults above."""

    def __getattr__(self, name: str) -> Any:
        try:
            spec = DEFAULTS[name]
        except KeyError:
            raise AttributeError(f"unknown outbox setting {name!r}") from None
        return getattr(settings, f"OUTBOX_{name}", spec.default)


outbox_settings = OutboxSettings()
