"""The subscriptions' admin: what fan-out creates deliveries for, who
serves it, retire and reactivate."""

from __future__ import annotations

from django.contrib import admin, messages
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ..exceptions import OutboxError
from ..ops import subscriptions as operations
from ..store.models import Subscription
from .base import OutboxAdminBase


class ServedFilter(admin.SimpleListFilter):
    title = gettext_lazy("served")
    parameter_name = "served"

    def lookups(self, request, model_admin):
        return [
            ("served", _("served by a running relay")),
            ("unserved", _("no running relay has it")),
            ("retired", _("retired")),
        ]

    def queryset(self, request, queryset):
        if self.value() == "served":
            return queryset.served()
        if self.value() == "unserved":
            return queryset.unserved()
        if self.value() == "retired":
            return queryset.filter(retired_at__isnull=False)
        return queryset


@admin.register(Subscription)
class SubscriptionAdmin(OutboxAdminBase, admin.ModelAdmin):
    """What fan-out creates deliveries for: every relay's subscribers, one
    row per subscriber and event type. Retire a subscriber gone from the code
    (its waiting deliveries skipped or kept), or reactivate it."""

    list_display = [
        "subscriber",
        "event_type",
        "kind",
        "ordered",
        "served",
        "last_seen_at",
        "last_seen_by",
        "retired_at",
        "retired_by",
    ]
    list_filter = [ServedFilter, "kind", "ordered"]
    search_fields = ["subscriber", "event_type", "last_seen_by"]
    ordering = ["subscriber", "event_type"]
    actions = ["retire_skipping_waiting", "retire_keeping_waiting", "reactivate"]

    @admin.display(boolean=True, description=gettext_lazy("served"))
    def served(self, obj: Subscription) -> bool | None:
        return None if obj.retired_at is not None else obj.is_served()

    @admin.action(
        permissions=["requeue"],
        description=gettext_lazy(
            "Retire selected subscriptions and skip their waiting deliveries"
        ),
    )
    def retire_skipping_waiting(self, request, queryset):
        self._retire(request, queryset, "skip")

    @admin.action(
        permissions=["requeue"],
        description=gettext_lazy(
            "Retire selected subscriptions and keep their waiting deliveries"
        ),
    )
    def retire_keeping_waiting(self, request, queryset):
        self._retire(request, queryset, "keep")

    def _retire(self, request, queryset, waiting: str) -> None:
        ids = list(queryset.active().values_list("pk", flat=True))
        try:
            retired, skipped = operations.retire(
                queryset, waiting=waiting, by=f"admin: {request.user.get_username()}"
            )
        except OutboxError as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return
        if not retired:
            self.message_user(
                request,
                _("Nothing was retired: they were retired already."),
                messages.WARNING,
            )
            return
        log = (
            _("Retired; its waiting deliveries skipped.")
            if waiting == "skip"
            else _("Retired; its waiting deliveries kept.")
        )
        self._log(request, Subscription, ids, retired, log)
        self.message_user(
            request,
            ngettext(
                "%(count)d subscription was retired",
                "%(count)d subscriptions were retired",
                retired,
            )
            % {"count": retired}
            + ngettext(
                "; %(count)d waiting delivery was skipped.",
                "; %(count)d waiting deliveries were skipped.",
                skipped,
            )
            % {"count": skipped},
            messages.SUCCESS,
        )

    @admin.action(
        permissions=["requeue"],
        description=gettext_lazy("Reactivate selected retired subscriptions"),
    )
    def reactivate(self, request, queryset):
        ids = list(
            queryset.filter(retired_at__isnull=False).values_list("pk", flat=True)
        )
        count = operations.reactivate(queryset)
        if count:
            self._log(request, Subscription, ids, count, _("Reactivated."))
            self.message_user(
                request,
                ngettext(
                    "%(count)d subscription was reactivated.",
                    "%(count)d subscriptions were reactivated.",
                    count,
                )
                % {"count": count},
                messages.SUCCESS,
            )
        else:
            self.message_user(request, _("Nothing was retired."), messages.WARNING)
