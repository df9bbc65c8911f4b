from django.apps import AppConfig
from django.utils.translation import gettext_lazy as _


class OutboxConfig(AppConfig):
    name = "outbox_app"
    verbose_name = _("Outbox")
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from django.utils.module_loading import autodiscover_modules

        from .ops import checks  # noqa: F401  (registers the system checks)
        from .publishing.outbox import events_committed
        from .relay.wake import wake_relays

        events_committed.connect(wake_relays, dispatch_uid="outbox_app.wake_relays")

        # Handlers live in each app's handlers.py, as admin classes live in admin.py.
        autodiscover_modules("handlers")
        # Consumers of the inbox (manage.py consume) in each app's consumers.py.
        autodiscover_modules("consumers")
        # Translators of recorded domain events (outbox_app.publishing.aggregates).
        autodiscover_modules("translators")
