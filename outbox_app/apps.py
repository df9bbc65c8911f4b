from typing import Any

from django.apps import AppConfig
from django.db.models.signals import post_migrate
from django.utils.translation import gettext_lazy as _


def _wake_celery(sender: Any, using: str, **kwargs: Any) -> None:
    """``events_committed`` receiver: with ``OUTBOX_CELERY_WAKE``, enqueue the
    Celery relay task (``tasks.wake``); Celery is imported only then."""
    from .conf import outbox_settings

    if outbox_settings.CELERY_WAKE:
        from .tasks import wake

        wake(using)


def _record_subscribers(sender: Any, using: str, **kwargs: Any) -> None:
    """``post_migrate`` receiver: record this code's subscribers (handlers and
    publishers) on the database just migrated, as ``manage.py
    outbox_subscribers --record`` does. A subscriber's stream delivery
    starts when it is first recorded, so one added with a deploy receives
    the events committed from its ``migrate`` on, before any relay of the
    new version runs. A configuration that cannot be read (a malformed
    publisher) records nothing: ``manage.py check`` says why."""
    if sender.name != OutboxConfig.name:
        return
    from django.core.exceptions import ImproperlyConfigured
    from django.db import connections

    from .events.ids import worker_name
    from .relay.registry import subscribers
    from .store.models import Cursor, Subscription

    tables = connections[using].introspection.table_names()
    if Cursor._meta.db_table not in tables:  # migrated back below stream delivery
        return
    try:
        found = subscribers()
    except ImproperlyConfigured:
        return
    Subscription.objects.using(using).record(
        found, f"migrate@{worker_name()}", heartbeat=False
    )


#: ``(alias, registry version)`` pairs whose subscribers all have cursors
#: (:func:`_know_subscribers`).
_known: set[tuple[str, tuple]] = set()


def _know_subscribers(sender: Any, using: str, **kwargs: Any) -> None:
    """``events_writing`` receiver: give the subscribers this process has
    that have no cursor on ``using`` theirs (a handler or publisher added
    since the last ``migrate``, one a test configures), inside the
    publishing transaction, so each receives the events written from now
    on, this one included. One query per database and per change of the
    subscribers (``relay.registry.version``), two where a subscriber had
    none; none with delivery rows. A
    configuration that cannot be read (a malformed publisher) records
    nothing here: ``manage.py check`` and the relay say why."""
    from .relay import registry

    key = (using, registry.version())
    if key in _known:
        return
    from django.core.exceptions import ImproperlyConfigured
    from django.db import transaction

    from .store.gateway import streaming
    from .store.models import Cursor

    if streaming(using):
        try:
            found = registry.subscribers()
        except ImproperlyConfigured:
            return
        cursors = Cursor.objects.using(using)
        have = set(
            cursors.filter(subscriber__in=[s.name for s in found])
            .values_list("subscriber", flat=True)
            .distinct()
        )
        missing = [s for s in found if s.name not in have]
        if missing:
            with transaction.atomic(using=using):  # a savepoint
                cursors.ensure(missing)
            # Known once a write finds them all: another open transaction
            # may be creating some (CursorQuerySet.ensure does not wait).
            return
    transaction.on_commit(lambda: _known.add(key), using=using)


class OutboxConfig(AppConfig):
    name = "outbox_app"
    verbose_name = _("Outbox")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from .ops import checks  # noqa: F401  (registers the system checks)
        from .publishing import tracking
        from .publishing.outbox import events_committed, events_writing
        from .relay.wake import wake_relays

        tracking.connect_signals()
        post_migrate.connect(_record_subscribers, dispatch_uid="outbox_app.record")
        events_writing.connect(_know_subscribers, dispatch_uid="outbox_app.know")
        events_committed.connect(wake_relays, dispatch_uid="outbox_app.wake_relays")
        events_committed.connect(_wake_celery, dispatch_uid="outbox_app.wake_celery")

        # Handlers live in each app's handlers.py, as admin classes live in admin.py.
        autodiscover_modules("handlers")
        # Consumers of the inbox (manage.py consume) in each app's consumers.py.
        autodiscover_modules("consumers")
        # Translators of recorded domain events (outbox_app.publishing.aggregates).
        autodiscover_modules("translators")
