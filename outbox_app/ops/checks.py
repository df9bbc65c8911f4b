"""System checks: ``python manage.py check`` reports malformed outbox settings.

Ids: ``outbox.E001``-``outbox.E0xx`` for settings that cannot work,
``outbox.W0xx`` for ones that probably do not do what was meant (``W010``: a
setting still set under the name it had before the last rename).
"""

from __future__ import annotations

import contextlib
import difflib
import warnings

from django.conf import settings
from django.core import checks
from django.core.exceptions import ImproperlyConfigured

from ..conf import (
    RENAMED,
    SETTINGS,
    mask_url,
    outbox_settings,
    positive_number,
    valid_publishers,
)
from ..exceptions import OutboxDeprecationWarning
from ..publishers.base import DEFAULT_BACKEND


@checks.register("outbox")
def check_settings(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Each ``OUTBOX_*`` setting has the right type and range."""
    messages: list[checks.CheckMessage] = list(_renamed_in_use())
    for name, spec in SETTINGS.items():
        with warnings.catch_warnings():  # a former name: W010 says it
            warnings.simplefilter("ignore", OutboxDeprecationWarning)
            value = outbox_settings.raw(name)
        if not spec.valid(value):
            messages.append(
                checks.Error(
                    f"OUTBOX_{name} is {mask_url(repr(value))}; it must be "
                    f"{spec.expected}.",
                    hint=f"Fix or remove OUTBOX_{name} (default: {spec.default!r}).",
                    id=spec.check,
                )
            )
    base = outbox_settings.raw("RETRY_BASE_SECONDS")
    cap = outbox_settings.raw("RETRY_MAX_SECONDS")
    if positive_number(base) and positive_number(cap) and base > cap:
        messages.append(
            checks.Error(
                f"OUTBOX_RETRY_BASE_SECONDS ({base}) is larger than "
                f"OUTBOX_RETRY_MAX_SECONDS ({cap}).",
                hint="The first retry delay cannot exceed the largest one.",
                id="outbox.E013",
            )
        )
    if outbox_settings.raw("CELERY_WAKE") is True:
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
        else:
            messages.extend(_check_celery_app())
    elif _sends_tasks():  # Celery missing: the entry's BACKEND fails to import
        with contextlib.suppress(ImportError):
            messages.extend(_check_celery_app())
    unknown = sorted(
        name
        for name in dir(settings)
        if name.startswith("OUTBOX_")
        and name[len("OUTBOX_") :] not in SETTINGS
        and name[len("OUTBOX_") :] not in RENAMED
    )
    messages.extend(
        checks.Warning(
            f"{name} is not an outbox_app setting and is ignored.",
            hint=_spelling_hint(name),
            id="outbox.W001",
        )
        for name in unknown
    )
    return messages


def _renamed_in_use() -> list[checks.CheckMessage]:
    """``outbox.W010`` for each setting still set under a former name: read
    in its place until the next release, or ignored when both are set."""
    found = []
    for old, spec in sorted(RENAMED.items()):
        if not hasattr(settings, f"OUTBOX_{old}"):
            continue
        new = f"OUTBOX_{spec.name}"
        if hasattr(settings, new):
            message = f"OUTBOX_{old} is ignored: it is renamed {new}, which is set."
            hint = f"Remove OUTBOX_{old}."
        else:
            message = (
                f"OUTBOX_{old} is renamed {new}; the old name is read until "
                "the next release."
            )
            hint = f"Rename OUTBOX_{old} to {new}."
        found.append(checks.Warning(message, hint=hint, id="outbox.W010"))
    return found


def _spelling_hint(name: str) -> str:
    known = [f"OUTBOX_{setting}" for setting in SETTINGS]
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
    if close:
        return f"Did you mean {close[0]}?"
    return "Check the spelling: outbox_app's settings are " + ", ".join(known) + "."


def _backend(options) -> str:
    """The dotted path of a publisher entry's class, for ``python -m pydoc``:
    its docstring lists the options (the docs/ pages are not in the wheel)."""
    backend = options.get("BACKEND", DEFAULT_BACKEND)
    return backend if isinstance(backend, str) else DEFAULT_BACKEND


@checks.register("outbox")
def check_subscribers(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Publishers can be built; handlers listen to event types that exist."""
    from django.core.exceptions import ImproperlyConfigured

    from ..inbox.registry import consumers
    from ..publishers.base import build_publisher
    from ..relay.registry import handlers

    messages: list[checks.CheckMessage] = []
    built = []
    if valid_publishers(outbox_settings.raw("PUBLISHERS")):
        for name, options in outbox_settings.PUBLISHERS.items():
            try:
                publisher = build_publisher(name, options)
            except ImproperlyConfigured as exc:
                messages.append(
                    checks.Error(
                        mask_url(str(exc)),
                        hint="Check BACKEND and the options: "
                        f"`python -m pydoc {_backend(options)}` lists them.",
                        id="outbox.E015",
                    )
                )
                continue
            built.append(publisher)
            messages.extend(
                checks.Warning(
                    f"publisher {name!r}: {mask_url(warning)}",
                    hint=f"`python -m pydoc {_backend(options)}` explains the "
                    "publisher's options.",
                    id="outbox.W005",
                )
                for warning in publisher.warnings()
            )
            messages.extend(
                checks.Warning(
                    f"publisher {name!r} cannot send: a package it needs is "
                    f"not installed (pip install {package}).",
                    hint="Install it where the relay runs; until then the "
                    "publisher stays paused and its events wait.",
                    id="outbox.W007",
                )
                for package in publisher.missing_packages()
            )
    known = known_types()
    for subscriber in [*handlers(), *built]:
        for event_type in sorted((subscriber.event_types or set()) - known):
            messages.append(
                checks.Warning(
                    f"{subscriber.kind} {subscriber.name!r} is registered for event "
                    f"type {event_type!r}, which no Event class or tracked model "
                    "defines.",
                    hint="Fine for events published as mappings; otherwise check "
                    "the spelling or import the module that defines the class.",
                    id="outbox.W002",
                )
            )
    # Consumers receive other services' types, which this one need not
    # define: only a near miss of a type it knows is worth a word.
    for consumer in consumers():
        for event_type in sorted((consumer.event_types or set()) - known):
            near = difflib.get_close_matches(event_type, known, n=1)
            if near:
                messages.append(
                    checks.Warning(
                        f"consumer {consumer.name!r} is registered for event type "
                        f"{event_type!r}, which nothing here defines; did you "
                        f"mean {near[0]!r}?",
                        hint="Fine for another service's type of that name; "
                        "otherwise correct the spelling.",
                        id="outbox.W002",
                    )
                )
    return messages


def known_types() -> frozenset[str]:
    """The event types this process defines: its Event classes, its tracked
    models' change events and enqueued Celery tasks."""
    from ..events.types import registered_event_types
    from ..publishing.enqueue import TASK_EVENT_TYPE
    from ..publishing.tracking import tracked_models

    tracked = {
        spec.event_type(operation)
        for spec in tracked_models()
        for operation in spec.suffixes
    }
    return registered_event_types() | tracked | {TASK_EVENT_TYPE}


@checks.register("outbox", checks.Tags.models)
def check_recording_models(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """``RecordsEvents`` comes before ``models.Model`` in a model's bases:
    after it, Django's ``save()`` runs instead and recorded events are never
    published."""
    from django.apps import apps
    from django.db import models

    from ..publishing.aggregates import RecordsEvents

    return [
        checks.Error(
            f"{model._meta.label} lists RecordsEvents after models.Model: its "
            "save() is Django's, and the events it records are never published.",
            hint=f"class {model.__name__}(RecordsEvents, models.Model): ...",
            obj=model,
            id="outbox.E027",
        )
        for config in (app_configs or apps.get_app_configs())
        for model in config.get_models()
        if issubclass(model, RecordsEvents)
        and model.__mro__.index(models.Model) < model.__mro__.index(RecordsEvents)
    ]


@checks.register("outbox", checks.Tags.database)
def check_subscriptions(app_configs=None, databases=None, **kwargs):
    """Under ``check --database``: a subscription no handler or publisher of
    this process has (one removed from the code or settings) still gets
    deliveries that nobody makes."""
    from django.db import DatabaseError

    from ..relay.registry import handlers, publishers
    from ..store.models import Subscription

    messages: list[checks.CheckMessage] = []
    if not databases:
        return messages
    try:
        subscribers = [*handlers(), *publishers()]
    except ImproperlyConfigured:  # a publisher that cannot be built: E015
        return messages
    known = {s.name for s in subscribers}
    known |= {alias for s in subscribers for alias in s.aliases}
    for alias in databases:
        try:
            live = set(
                Subscription.objects.using(alias)
                .filter(retired_at__isnull=True)
                .values_list("subscriber", flat=True)
            )
        except DatabaseError:  # not migrated yet
            continue
        messages.extend(
            checks.Warning(
                f"subscription {name!r} (database {alias!r}) is live, but no "
                "handler or publisher of this process has that name: its "
                "deliveries wait for a relay that will never make them.",
                hint=f"Once no deployed code has it, retire it: python manage.py "
                f"outbox_subscribers --retire {name} (or rename it back, or "
                "list the old name in ALIASES).",
                id="outbox.W008",
            )
            for name in sorted(live - known)
        )
    return messages


def _sends_tasks() -> bool:
    """Some ``OUTBOX_PUBLISHERS`` entry sends enqueued Celery tasks."""
    from ..publishing.enqueue import TASK_BACKEND

    entries = outbox_settings.raw("PUBLISHERS")
    return valid_publishers(entries) and any(
        options.get("BACKEND") == TASK_BACKEND for options in entries.values()
    )


def _check_celery_app() -> list[checks.CheckMessage]:
    """The app wake-ups are sent with can be built, and names a broker."""
    from ..publishers.celery import celery_app

    path = outbox_settings.raw("CELERY_APP")
    if not SETTINGS["CELERY_APP"].valid(path):
        return []  # reported by its rule (E017)
    try:
        celery_app()
    except ImproperlyConfigured as exc:
        return [
            checks.Error(
                str(exc),
                hint="Name your project's Celery app, or remove OUTBOX_CELERY_APP "
                "to use one configured from the CELERY_* settings.",
                id="outbox.E017",
            )
        ]
    if path is None and not hasattr(settings, "CELERY_BROKER_URL"):
        return [
            checks.Warning(
                "outbox_app sends to Celery (OUTBOX_CELERY_WAKE, or a "
                "CeleryPublisher for enqueued tasks), but neither OUTBOX_CELERY_APP "
                "nor CELERY_BROKER_URL is set: it would send to Celery's default "
                "broker (amqp://guest@localhost//), where your workers may not "
                "listen.",
                hint='Set OUTBOX_CELERY_APP = "yourproject.celery.app", or '
                "configure Celery from Django settings (CELERY_BROKER_URL).",
                id="outbox.W004",
            )
        ]
    return []


@checks.register("outbox", checks.Tags.models)
def check_tracked_models(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """``@track``'s ``names`` map operations only; every manager of a tracked
    model gives tracked querysets (one that builds a plain ``QuerySet``
    itself writes without publishing)."""
    from ..publishing.tracking import SUFFIXES, TrackedQuerySet, tracked_models

    bypassing = [
        checks.Warning(
            f"@track on {spec.model._meta.label}: the manager {manager.name!r} "
            "returns querysets that are not tracked: its update(), delete(), "
            "bulk_create() and bulk_update() publish no change events.",
            hint="Build its queryset with super().get_queryset() (or the "
            "manager's own _queryset_class), not QuerySet(...) directly.",
            obj=spec.model,
            id="outbox.W009",
        )
        for spec in tracked_models()
        for manager in spec.model._meta.managers
        if not isinstance(manager.get_queryset(), TrackedQuerySet)
    ]
    return bypassing + [
        checks.Error(
            f"@track on {spec.model._meta.label}: names has key(s) "
            f"{list(spec.unknown_names)}, which are no operation.",
            hint=f"Use {sorted(SUFFIXES)}: each maps to its event type's suffix.",
            obj=spec.model,
            id="outbox.E026",
        )
        for spec in tracked_models()
        if spec.unknown_names
    ]


@checks.register("outbox", checks.Tags.database)
def check_sqlite_relays(app_configs=None, databases=None, **kwargs):
    """SQLite runs one relay per database file (its dialect is single-writer;
    an alias on a database outbox_app has no dialect for is left alone)."""
    from django.db import connections

    from ..store.sql import dialect_if_supported

    if outbox_settings.raw("CELERY_WAKE") is not True:
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
        if (found := dialect_if_supported(alias)) and found.single_writer
    ]


@checks.register("outbox", checks.Tags.security, deploy=True)
def check_metrics_token(app_configs=None, **kwargs) -> list[checks.CheckMessage]:
    """Under ``check --deploy``: a routed metrics view has a token to check
    (without one it answers every request outside DEBUG with 403)."""
    if outbox_settings.raw("METRICS_TOKEN"):
        return []
    route = _metrics_route()
    if route is None:
        return []
    return [
        checks.Warning(
            f"The outbox's metrics view is routed at {route!r} but "
            "OUTBOX_METRICS_TOKEN is not set: it answers 403 to every request "
            "while DEBUG is False, so Prometheus scrapes nothing.",
            hint="Set OUTBOX_METRICS_TOKEN (16 characters or more) and scrape "
            "with Authorization: Bearer <token>.",
            id="outbox.W006",
        )
    ]


def _metrics_route() -> str | None:
    """The first route of the project's URLconf whose view is
    :func:`outbox_app.ops.metrics.metrics_view`, as written there (the
    prefixes of its includes joined); None
    when there is none or the URLconf cannot be loaded (Django's own checks
    report that)."""
    from django.urls import URLPattern, URLResolver, get_resolver

    from .metrics import metrics_view

    def walk(patterns, prefix: str) -> str | None:
        for pattern in patterns:
            if isinstance(pattern, URLResolver):
                found = walk(pattern.url_patterns, prefix + str(pattern.pattern))
                if found is not None:
                    return found
            elif isinstance(pattern, URLPattern) and pattern.callback is metrics_view:
                return prefix + str(pattern.pattern)
        return None

    try:
        return walk(get_resolver().url_patterns, "")
    except Exception:  # a URLconf that does not load: Django's checks report it
        return None
