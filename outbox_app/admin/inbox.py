"""The inbox's admin: messages consumers received (``manage.py consume``),
the failing and dead ones with their error, and "requeue"; and the
consumers ``consume`` processes recorded."""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.http import Http404, HttpResponseNotAllowed, HttpResponseRedirect
from django.urls import path, reverse
from django.utils.formats import date_format
from django.utils.html import format_html
from django.utils.timezone import localtime
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ..store.clock import database_now
from ..store.lifecycle import INBOX_REQUEUEABLE, InboxState
from ..store.models import ConsumerSubscription, InboxMessage
from ..templatetags.outbox_admin import duration
from .base import (
    LOG_EACH_MAX,
    OutboxAdminBase,
    error_summary,
    error_words,
    pre,
    pretty_json,
)
from .subscriptions import ServedFilter

#: Badge colours, as the deliveries' (base.STATE_COLOURS).
COLOURS = {
    InboxState.HANDLED: "#2e7d32",
    InboxState.FAILED: "#b35c00",
    InboxState.DEAD: "var(--error-fg, #ba2121)",
}


@admin.register(InboxMessage)
class InboxMessageAdmin(OutboxAdminBase, admin.ModelAdmin):
    list_display = [
        "id",
        "consumer",
        "event_type",
        "state_label",
        "next_retry",
        "short_error",
        "received",
    ]
    list_display_links = ["id"]
    change_form_template = "admin/outbox_app/transitions_change_form.html"
    list_filter = [
        "state",
        "consumer",
        "source",
        "queue",
        "event_type",
        "last_error_type",
    ]
    search_fields = ["=message_id", "=aggregate_id"]
    search_help_text = gettext_lazy(
        "Message id (the event id), aggregate id, inbox id (exact) or words of "
        "the last error."
    )
    show_full_result_count = False
    actions = ["requeue_selected"]
    readonly_fields = ["state_label", "next_retry", "body_pretty", "traceback_text"]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "consumer",
                    "source",
                    "message_id",
                    "queue",
                    "event_type",
                    "aggregate_type",
                    "aggregate_id",
                    "state_label",
                    "attempts",
                    "next_retry",
                    "received_at",
                    "handled_at",
                ]
            },
        ),
        (
            gettext_lazy("Last error"),
            {"fields": ["last_error_type", "last_error", "traceback_text"]},
        ),
        (gettext_lazy("Message"), {"fields": ["body_digest", "body_pretty"]}),
    ]

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        query = Q(message_id=term) | Q(aggregate_id=term) | error_words(term)
        if term.isdigit():
            query |= Q(pk=int(term))
        return queryset.filter(query), False

    def has_requeue_permission(self, request) -> bool:
        """``outbox_app.requeue_inboxmessage``."""
        opts = InboxMessage._meta
        codename = get_permission_codename("requeue", opts)
        return request.user.has_perm(f"{opts.app_label}.{codename}")

    @admin.display(description=gettext_lazy("state"), ordering="state")
    def state_label(self, obj: InboxMessage):
        """The coloured state and, once tried more than once, its attempts
        ("dead x5", with a multiplication sign), as the deliveries'."""
        label = format_html(
            '<strong style="color: {}">{}</strong>',
            COLOURS.get(obj.state, "inherit"),
            obj.get_state_display(),
        )
        if obj.attempts < 2:
            return label
        return format_html(
            '{} <span title="{}" style="white-space: nowrap">&times;{}</span>',
            label,
            _("attempts"),
            obj.attempts,
        )

    @admin.display(description=gettext_lazy("received"), ordering="received_at")
    def received(self, obj: InboxMessage):
        """How long ago, on one line; the exact time is the title."""
        seconds = (database_now(obj._state.db) - obj.received_at).total_seconds()
        return format_html(
            '<span title="{}" style="white-space: nowrap">{}</span>',
            date_format(localtime(obj.received_at), "DATETIME_FORMAT"),
            _("%(ago)s ago") % {"ago": duration(max(seconds, 0))},
        )

    @admin.display(description=gettext_lazy("next try"), ordering="next_retry_at")
    def next_retry(self, obj: InboxMessage):
        """When ``consume`` runs a FAILED message again, from now; "-" for a
        handled or dead one, whose ``next_retry_at`` means nothing."""
        if obj.state != InboxState.FAILED or obj.next_retry_at is None:
            return "-"
        seconds = (obj.next_retry_at - database_now(obj._state.db)).total_seconds()
        if seconds <= 0:
            return _("due")
        return _("in %(left)s") % {"left": duration(seconds)}

    @admin.display(description=gettext_lazy("last error"))
    def short_error(self, obj: InboxMessage):
        return error_summary(obj.last_error_type, obj.last_error)

    @admin.display(description=gettext_lazy("traceback"))
    def traceback_text(self, obj: InboxMessage):
        return pre(obj.last_traceback) if obj.last_traceback else "-"

    @admin.display(description=gettext_lazy("body"))
    def body_pretty(self, obj: InboxMessage):
        if not obj.body:
            return "-"
        try:
            return pretty_json(json.loads(obj.body))
        except ValueError:
            return pre(obj.body)

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        return [
            path(
                "<path:object_id>/requeue/",
                self.admin_site.admin_view(self.requeue_view),
                name="{}_{}_requeue".format(*info),
            ),
            *super().get_urls(),
        ]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        """A failed or dead message's page has a Requeue button (with the
        requeue permission)."""
        row = self.get_object(request, unquote(object_id))
        buttons = []
        if (
            row is not None
            and row.state in INBOX_REQUEUEABLE
            and self.has_requeue_permission(request)
        ):
            buttons = [
                {
                    "label": _("Requeue"),
                    "title": _("Due now, attempts reset: consume runs it again."),
                    "url": reverse(
                        f"{self.admin_site.name}:outbox_app_inboxmessage_requeue",
                        args=[quote(row.pk)],
                    ),
                }
            ]
        extra_context = {**(extra_context or {}), "outbox_transitions": buttons}
        return super().change_view(request, object_id, form_url, extra_context)

    def requeue_view(self, request, object_id: str):
        """POST from a message's page: requeue it, then back to the page."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_requeue_permission(request):
            raise PermissionDenied
        row = self.get_object(request, unquote(object_id))
        if row is None:
            raise Http404(f"no inbox message {object_id!r}")
        self._requeue(request, InboxMessage.objects.filter(pk=row.pk))
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:outbox_app_inboxmessage_change",
                args=[quote(row.pk)],
            )
        )

    @admin.action(
        permissions=["requeue"],
        description=gettext_lazy("Requeue the selected failed or dead messages"),
    )
    def requeue_selected(self, request, queryset):
        self._requeue(request, queryset)

    def _requeue(self, request, queryset) -> None:
        logged = list(
            queryset.filter(state__in=INBOX_REQUEUEABLE).values_list("pk", flat=True)[
                : LOG_EACH_MAX + 1
            ]
        )
        count = queryset.requeue()
        if not count:
            self.message_user(
                request,
                _("No failed or dead message was selected."),
                messages.WARNING,
            )
            return
        self._log(request, InboxMessage, logged, count, "Requeued")
        self.message_user(
            request,
            ngettext(
                "%(count)d message requeued: consume runs it again.",
                "%(count)d messages requeued: consume runs them again.",
                count,
            )
            % {"count": count},
            messages.SUCCESS,
        )


@admin.register(ConsumerSubscription)
class ConsumerSubscriptionAdmin(OutboxAdminBase, admin.ModelAdmin):
    """The consumers ``consume`` processes recorded, one row per consumer,
    queue and event type: a process that lacks an active one keeps its
    messages for it. ``manage.py outbox_subscribers --retire`` retires one."""

    list_display = [
        "consumer",
        "queue",
        "event_type",
        "ordered",
        "served",
        "last_seen_at",
        "last_seen_by",
        "retired_at",
        "retired_by",
    ]
    list_filter = [ServedFilter, "queue", "ordered"]
    search_fields = ["consumer", "event_type", "last_seen_by"]
    ordering = ["consumer", "queue", "event_type"]

    @admin.display(boolean=True, description=gettext_lazy("served"))
    def served(self, obj: ConsumerSubscription) -> bool | None:
        return None if obj.retired_at is not None else obj.is_served()
