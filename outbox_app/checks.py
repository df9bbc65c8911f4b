"""System checks: ``python manage.py check`` reports malformed outbox settings.

Ids: ``outbox.E001``-``outbox.E0xx`` for settings that cannot work,
``outbox.W0xx`` for ones that probably do not do what was meant.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from django.conf import settings
from django.core import checks

from .conf import DEFAULTS, outbox_settings


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _non_negative_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _positive_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and value > 0


def _namespace(value: Any) -> bool:
    return isinstance(value, str) and len(value.strip()) > 0 and len(value) <= 255


def _publishers(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, dict) for k, v in value.items()
    )


#: setting -> (check id, predicate, what a valid value is)
RULES: dict[str, tuple[str, Callable[[Any], bool], str]] = {
    "NAMESPACE": (
        "outbox.E001",
        _namespace,
        "a non-empty string of at most 255 characters",
    ),
    "MAX_PAYLOAD_BYTES": ("outbox.E002", _positive_int, "a positive integer (bytes)"),
    "MAX_ATTEMPTS": ("outbox.E003", _positive_int, "a positive integer"),
    "RETRY_BASE_SECONDS": (
        "outbox.E004",
        _positive_number,
        "a positive number of seconds",
    ),
    "RETRY_MAX_SECONDS": (
        "outbox.E005",
        _positive_number,
        "a positive number of seconds",
    ),
    "LEASE_SECONDS": ("outbox.E006", _positive_number, "a positive number of seconds"),
    "BATCH_SIZE": ("outbox.E007", _positive_int, "a positive integer (rows)"),
    "POLL_INTERVAL": ("outbox.E008", _positive_number, "a positive number of seconds"),
    "RETENTION_DAYS": ("outbox.E009", _positive_int, "a positive integer (days)"),
    "PUBLISHERS": ("outbox.E010", _publishers, "a dict of name -> dict of options"),
    "CELERY_WAKE": ("outbox.E011", lambda v: isinstance(v, bool), "True or False"),
    "TRACEBACK_MAX_CHARS": ("outbox.E012", _non_negative_int, "a non-negative integer"),
    "PAUSE_MAX_SECONDS": (
        "outbox.E016",
        _positive_number,
        "a positive number of seconds",
    ),
}


@checks.register("outbox")
def check_settings(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Each ``OUTBOX_*`` setting has the right type and range."""
    messages: list[checks.CheckMessage] = []
    for name, (check_id, valid, expected) in RULES.items():
        value = getattr(outbox_settings, name)
        if not valid(value):
            messages.append(
                checks.Error(
                    f"OUTBOX_{name} is {value!r}; it must be {expected}.",
                    hint=f"Fix or remove OUTBOX_{name} (default: "
                    f"{DEFAULTS[name].default!r}). See docs/settings.md.",
                    id=check_id,
                )
            )
    base, cap = outbox_settings.RETRY_BASE_SECONDS, outbox_settings.RETRY_MAX_SECONDS
    if _positive_number(base) and _positive_number(cap) and base > cap:
        messages.append(
            checks.Error(
                f"OUTBOX_RETRY_BASE_SECONDS ({base}) is larger than "
                f"OUTBOX_RETRY_MAX_SECONDS ({cap}).",
                hint="The first retry delay cannot exceed the largest one.",
                id="outbox.E013",
            )
        )
    if outbox_settings.CELERY_WAKE is True:
        try:
            import celery  # noqa: F401
        except ImportError:
            messages.append(
                checks.Error(
                    "OUTBOX_CELERY_WAKE is True but Celery is not installed.",
                    hint="pip install 'outbox_app[celery]', or set it to False.",
                    id="outbox.E014",
                )
            )
    unknown = sorted(
        name
        for name in dir(settings)
        if name.startswith("OUTBOX_") and name[len("OUTBOX_") :] not in DEFAULTS
    )
    messages.extend(
        checks.Warning(
            f"{name} is not an outbox_app setting and is ignored.",
            hint="Check the spelling against docs/settings.md.",
            id="outbox.W001",
        )
        for name in unknown
    )
    return messages


@checks.register("outbox")
def check_subscribers(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Publishers can be built; handlers listen to event types that exist."""
    from django.core.exceptions import ImproperlyConfigured

    from .events import registered_event_types
    from .publishers.base import build_publisher
    from .registry import handlers

    messages: list[checks.CheckMessage] = []
    if _publishers(outbox_settings.PUBLISHERS):
        for name, options in outbox_settings.PUBLISHERS.items():
            try:
                build_publisher(name, options)
            except ImproperlyConfigured as exc:
                messages.append(
                    checks.Error(
                        str(exc),
                        hint="Check BACKEND and the options in docs/brokers.md.",
                        id="outbox.E015",
                    )
                )
    known = registered_event_types()
    for handler in handlers():
        for event_type in sorted(handler.event_types - known):
            messages.append(
                checks.Warning(
                    f"handler {handler.name!r} is registered for event type "
                    f"{event_type!r}, which no Event class defines.",
                    hint="Fine for events published as mappings; otherwise check "
                    "the spelling or import the module that defines the class.",
                    id="outbox.W002",
                )
            )
    return messages


@checks.register("outbox", checks.Tags.database)
def check_sqlite_relays(app_configs=None, databases=None, **kwargs):
    """SQLite runs one relay per database file."""
    from django.db import connections

    if outbox_settings.CELERY_WAKE is not True:
        return []
    return [
        checks.Warning(
            f"Database {alias!r} is SQLite and OUTBOX_CELERY_WAKE is on: Celery "
            "workers would run relays beside `manage.py relay`, but SQLite allows "
            "one relay per database file (the others skip their run).",
            hint="Run one relay: a single Celery worker or `manage.py relay`, not "
            "both; or use PostgreSQL or MySQL/MariaDB.",
            id="outbox.W003",
        )
        for alias in connections
        if connections[alias].vendor == "sqlite"
    ]
