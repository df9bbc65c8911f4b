"""The subscriptions' admin: what fan-out creates deliveries for, whether a
relay serves it now, whether it is paused; pause and resume a subscriber,
retire and reactivate a subscription."""

from __future__ import annotations

import datetime

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.db.models import OuterRef, Subquery
from django.utils.html import format_html
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ..exceptions import OutboxError
from ..ops import subscriptions as operations
from ..store.clock import database_now
from ..store.models import SubscriberPause, Subscription
from ..store.querysets import SERVING_SECONDS, serving
from ..templatetags.outbox_admin import duration
from .base import OutboxAdminBase


class ServedFilter(admin.SimpleListFilter):
    """By whether a process serves the subscription now, as the relay column
    (and ``outbox_subscribers``) say it: ``store.querysets.serving``."""

    title = gettext_lazy("served")
    parameter_name = "served"

    def lookups(self, request, model_admin):
        return [
            ("serving", _("serving: refreshed within 2 minutes")),
            ("stale", _("no relay now: 2 to 5 minutes")),
            ("unserved", _("unserved: longer")),
            ("retired", _("retired")),
        ]

    def queryset(self, request, queryset):
        now = database_now(queryset.db)
        serving_since = now - datetime.timedelta(seconds=SERVING_SECONDS)
        if self.value() == "serving":
            return queryset.active().filter(last_seen_at__gte=serving_since)
        if self.value() == "stale":
            return queryset.served(now).filter(last_seen_at__lt=serving_since)
        if self.value() == "served":  # its former choice, in bookmarks
            return queryset.served(now)
        if self.value() == "unserved":
            return queryset.unserved(now)
        if self.value() == "retired":
            return queryset.filter(retired_at__isnull=False)
        return queryset


class PausedFilter(admin.SimpleListFilter):
    title = gettext_lazy("paused by an operator")
    parameter_name = "paused"

    def lookups(self, request, model_admin):
        return [("yes", _("paused")), ("no", _("not paused"))]

    def queryset(self, request, queryset):
        if self.value() == "yes":
            return queryset.filter(paused_at__isnull=False)
        if self.value() == "no":
            return queryset.filter(paused_at__isnull=True)
        return queryset


#: How each answer of ``store.querysets.serving`` is shown: its words and
#: colour (a green dot for serving, the warning colour for the others).
SERVING = {
    "serving": (gettext_lazy("serving"), "#2e7d32"),
    "stale": (gettext_lazy("no relay now"), "#b35c00"),
    "unserved": (gettext_lazy("unserved"), "var(--error-fg, #ba2121)"),
    "retired": (gettext_lazy("retired"), "var(--body-quiet-color, #666)"),
}


def _ago(moment, now) -> str:
    return duration((now - moment).total_seconds())


@admin.register(Subscription)
class SubscriptionAdmin(OutboxAdminBase, admin.ModelAdmin):
    """What fan-out creates deliveries for: every relay's subscribers, one
    row per subscriber and event type. Pause a subscriber (no relay claims
    its deliveries until it is resumed), retire one gone from the code (its
    waiting deliveries skipped or kept), or reactivate it."""

    list_display = [
        "subscriber",
        "event_type",
        "kind_label",
        "relay",
        "last_served",
        "paused",
    ]
    list_filter = [ServedFilter, PausedFilter, "kind", "ordered"]
    search_fields = ["subscriber", "event_type", "last_seen_by"]
    ordering = ["subscriber", "event_type"]
    actions = [
        "pause_selected",
        "resume_selected",
        "retire_skipping_waiting",
        "retire_keeping_waiting",
        "reactivate",
    ]
    fields = [
        "subscriber",
        "event_type",
        "kind_label",
        "relay",
        "first_seen_at",
        "last_served",
        "paused",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        """Each row with its subscriber's outage, if a relay paused it (the
        destination is unavailable): when it began, the next probe, why."""
        outages = SubscriberPause.objects.paused(database_now()).filter(
            subscriber=OuterRef("subscriber")
        )
        return (
            super()
            .get_queryset(request)
            .annotate(
                outage_since=Subquery(outages.values("paused_at")[:1]),
                outage_probe=Subquery(outages.values("resume_at")[:1]),
                outage_reason=Subquery(outages.values("reason")[:1]),
            )
        )

    # --- permissions ---

    def _has(self, request, action: str) -> bool:
        opts = Subscription._meta
        codename = get_permission_codename(action, opts)
        return request.user.has_perm(f"{opts.app_label}.{codename}")

    def has_pause_permission(self, request) -> bool:
        """``outbox_app.pause_subscription``: pause and resume."""
        return self._has(request, "pause")

    def has_retire_permission(self, request) -> bool:
        """``outbox_app.retire_subscription``: retire and reactivate."""
        return self._has(request, "retire")

    # --- columns ---

    @admin.display(description=gettext_lazy("kind"), ordering="kind")
    def kind_label(self, obj: Subscription) -> str:
        return obj.kind + (", " + _("ordered") if obj.ordered else "")

    @admin.display(description=gettext_lazy("relay"), ordering="last_seen_at")
    def relay(self, obj: Subscription):
        """Whether a relay serves it now (refreshed within two minutes; a
        running relay refreshes it every minute); a retired one says when and
        by whom."""
        now = database_now(obj._state.db)
        words, colour = SERVING[serving(obj.retired_at, obj.last_seen_at, now)]
        badge = format_html(
            '<span style="color: {}; font-weight: 600; white-space: nowrap">'
            "● {}</span>",
            colour,
            words,
        )
        if obj.retired_at is None:
            return badge
        return format_html(
            '{}<br><small title="{}">{}</small>',
            badge,
            obj.retired_at.isoformat(),
            _("%(ago)s ago by %(who)s")
            % {"ago": _ago(obj.retired_at, now), "who": obj.retired_by or "?"},
        )

    @admin.display(description=gettext_lazy("last served"), ordering="last_seen_at")
    def last_served(self, obj: Subscription):
        """How long ago a relay last refreshed it, and which (the exact time is
        the title)."""
        return format_html(
            '<span title="{}">{}</span><br><small>{}</small>',
            obj.last_seen_at.isoformat(),
            _("%(ago)s ago")
            % {"ago": _ago(obj.last_seen_at, database_now(obj._state.db))},
            obj.last_seen_by or "?",
        )

    @admin.display(description=gettext_lazy("paused"), ordering="paused_at")
    def paused(self, obj: Subscription):
        """An outage of the publisher's destination (a relay paused it: it
        resumes by itself) or an operator's pause; "-" when neither."""
        now = database_now(obj._state.db)
        if obj.outage_since is not None:
            return format_html(
                '<strong class="outbox-paused" style="color: #b35c00" title="{}">'
                "{}</strong><br><small>{}</small>",
                obj.outage_reason,
                _("destination unavailable"),
                _("for %(since)s; next probe in %(next)s")
                % {
                    "since": _ago(obj.outage_since, now),
                    "next": duration(max((obj.outage_probe - now).total_seconds(), 0)),
                },
            )
        if obj.paused_at is not None:
            return format_html(
                '<strong class="outbox-paused" style="color: #b35c00">{}</strong>'
                "<br><small>{}</small>",
                _("by %(who)s") % {"who": obj.paused_by or "?"},
                _("for %(since)s") % {"since": _ago(obj.paused_at, now)},
            )
        return "-"

    # --- actions ---

    @admin.action(
        permissions=["pause"],
        description=gettext_lazy(
            "Pause the subscribers of the selected subscriptions (relays stop "
            "claiming their deliveries)"
        ),
    )
    def pause_selected(self, request, queryset):
        names = sorted(set(queryset.values_list("subscriber", flat=True)))
        count = operations.pause(queryset, by=f"admin: {request.user.get_username()}")
        if not count:
            self.message_user(
                request,
                _("Nothing was paused: they were paused already."),
                messages.WARNING,
            )
            return
        self._log_subscribers(
            request, names, _("Paused: no relay claims its deliveries.")
        )
        self.message_user(
            request,
            ngettext(
                "%(count)d subscriber was paused: its deliveries wait, with no "
                "attempt counted, until it is resumed.",
                "%(count)d subscribers were paused: their deliveries wait, with "
                "no attempt counted, until they are resumed.",
                count,
            )
            % {"count": count},
            messages.SUCCESS,
        )

    @admin.action(
        permissions=["pause"],
        description=gettext_lazy(
            "Resume the subscribers of the selected subscriptions"
        ),
    )
    def resume_selected(self, request, queryset):
        names = sorted(set(queryset.values_list("subscriber", flat=True)))
        count = operations.resume(queryset)
        if not count:
            self.message_user(request, _("Nothing was paused."), messages.WARNING)
            return
        self._log_subscribers(request, names, _("Resumed."))
        self.message_user(
            request,
            ngettext(
                "%(count)d subscriber was resumed: relays claim its deliveries again.",
                "%(count)d subscribers were resumed: relays claim their "
                "deliveries again.",
                count,
            )
            % {"count": count},
            messages.SUCCESS,
        )

    def _log_subscribers(self, request, names: list[str], message: str) -> None:
        """A pause is the subscriber's: one log entry on each of its rows."""
        ids = list(
            Subscription.objects.filter(subscriber__in=names).values_list(
                "pk", flat=True
            )
        )
        self._log(request, Subscription, ids, len(ids), message)

    @admin.action(
        permissions=["retire"],
        description=gettext_lazy(
            "Retire selected subscriptions and skip their waiting deliveries"
        ),
    )
    def retire_skipping_waiting(self, request, queryset):
        self._retire(request, queryset, "skip")

    @admin.action(
        permissions=["retire"],
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
        permissions=["retire"],
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
