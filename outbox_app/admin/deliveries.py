"""The deliveries' admin: the list, a delivery's page with the
transitions its state allows, the actions (one table, :data:`TRANSITIONS`),
and "requeue everything matching the current filter"."""

from __future__ import annotations

from typing import Any

from django.contrib import admin, messages
from django.contrib.admin.options import IncorrectLookupParameters
from django.contrib.admin.utils import quote, unquote
from django.contrib.admin.views.main import (
    ALL_VAR,
    ERROR_FLAG,
    IS_FACETS_VAR,
    ORDER_VAR,
    PAGE_VAR,
    SEARCH_VAR,
)
from django.core.exceptions import FieldDoesNotExist, PermissionDenied
from django.db.models import Exists, OuterRef, Q
from django.http import (
    Http404,
    HttpResponseNotAllowed,
    HttpResponsePermanentRedirect,
    HttpResponseRedirect,
)
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe
from django.utils.timezone import localtime
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ..relay.outcomes import LAPSED_ERROR_TYPE
from ..store import lifecycle
from ..store.clock import database_now
from ..store.lifecycle import State
from ..store.models import Delivery, Notification, SubscriberPause, Subscription
from ..templatetags.outbox_admin import duration
from .base import (
    LOG_EACH_MAX,
    OutboxAdminBase,
    as_uuid,
    error_summary,
    error_words,
    pre,
    short_uuid,
    state_badge,
)

#: What each operator's transition (``DeliveryQuerySet.apply``) is called
#: in the admin: its action, its button on a delivery's page, the admin log
#: line, and what it tells the operator.
TRANSITIONS: dict[str, dict[str, Any]] = {
    "requeue": {
        "action": gettext_lazy("Requeue selected deliveries (failed or dead)"),
        "button": gettext_lazy("Requeue"),
        "log": gettext_lazy("Requeued: due now, attempts reset."),
        "done": lambda n: ngettext(
            "%(count)d delivery was requeued.",
            "%(count)d deliveries were requeued.",
            n,
        ),
        "none": gettext_lazy(
            "Nothing was requeued: only failed or dead deliveries can be."
        ),
    },
    "retry_now": {
        "action": gettext_lazy("Retry selected failed deliveries now"),
        "button": gettext_lazy("Retry now"),
        "log": gettext_lazy("Retry now: due now."),
        "done": lambda n: ngettext(
            "%(count)d failed delivery is due now.",
            "%(count)d failed deliveries are due now.",
            n,
        ),
        "none": gettext_lazy(
            "Nothing to retry: only failed deliveries can be retried now."
        ),
    },
    "dead_letter": {
        "action": gettext_lazy("Dead-letter selected deliveries (stop retrying)"),
        "button": gettext_lazy("Dead-letter"),
        "log": gettext_lazy("Dead-lettered: no more attempts."),
        "done": lambda n: ngettext(
            "%(count)d delivery was dead-lettered.",
            "%(count)d deliveries were dead-lettered.",
            n,
        ),
        "none": gettext_lazy(
            "Nothing was dead-lettered: only pending or failed deliveries can be."
        ),
    },
    "skip": {
        "action": gettext_lazy(
            "Skip selected failed or dead deliveries (give up delivering)"
        ),
        "button": gettext_lazy("Skip"),
        "log": gettext_lazy("Skipped: will not be delivered; its aggregate flows on."),
        "done": lambda n: ngettext(
            "%(count)d delivery was skipped.",
            "%(count)d deliveries were skipped.",
            n,
        ),
        "none": gettext_lazy(
            "Nothing was skipped: only failed or dead deliveries can be."
        ),
    },
}

#: States whose last error is the row's current one (elsewhere it is history).
CURRENT_ERROR_STATES = (State.FAILED, State.DEAD)


def _transition_action(transition: str):
    """The admin action for one of :data:`TRANSITIONS`."""

    @admin.action(
        permissions=["requeue"], description=TRANSITIONS[transition]["action"]
    )
    def action(self, request, queryset):
        self._transition(request, queryset, transition)

    return action


class ScheduledFilter(admin.SimpleListFilter):
    """Deliveries waiting on purpose: their event is scheduled for later."""

    title = gettext_lazy("schedule")
    parameter_name = "schedule"

    def lookups(self, request, model_admin):
        return [("scheduled", _("scheduled for later"))]

    def queryset(self, request, queryset):
        if self.value() == "scheduled":
            return queryset.scheduled()
        return queryset


def next_try(obj: Delivery):
    """When it is due (PENDING, FAILED) or its lease runs out (RUNNING), from
    now; nothing for a finished row, whose ``next_retry_at`` means nothing;
    "paused" when its subscriber is (by an outage of its destination, or
    by an operator): no relay claims it, whatever its time. The exact time
    is the title."""
    if obj.state not in (State.PENDING, State.FAILED, State.RUNNING):
        return "-"
    seconds = (obj.next_retry_at - database_now(obj._state.db)).total_seconds()
    if obj.state == State.RUNNING:
        text = _("lease %(left)s") % {"left": duration(max(seconds, 0))}
    elif getattr(obj, "outage", False):
        return format_html(
            '<strong class="outbox-paused" style="color: #b35c00" title="{}">'
            "{}</strong>",
            _(
                "A relay paused this publisher: its destination is "
                "unavailable. The delivery waits, with no attempt counted, "
                "and is sent once a probe succeeds."
            ),
            _("paused: outage"),
        )
    elif getattr(obj, "held", False):
        return format_html(
            '<strong class="outbox-paused" style="color: #b35c00" title="{}">'
            "{}</strong>",
            _(
                "An operator paused this subscriber (Subscriptions): no "
                "relay claims its deliveries until it is resumed."
            ),
            _("paused by an operator"),
        )
    elif obj.deliver_at is not None and obj.deliver_at == obj.next_retry_at:
        text = (
            _("scheduled, in %(left)s") % {"left": duration(seconds)}
            if seconds > 0
            else _("due (scheduled)")
        )
    elif seconds > 0:
        text = _("in %(left)s") % {"left": duration(seconds)}
    else:
        text = _("due")
    return format_html(
        '<span title="{}" style="white-space: nowrap">{}</span>',
        date_format(localtime(obj.next_retry_at), "DATETIME_FORMAT"),
        text,
    )


@admin.register(Delivery)
class DeliveryAdmin(OutboxAdminBase, admin.ModelAdmin):
    list_display = [
        "id",
        "event_link",
        "subscriber_name",
        "state_label",
        "next_retry",
        "short_error",
    ]
    list_display_links = ["id"]
    change_form_template = "admin/outbox_app/transitions_change_form.html"
    list_filter = [
        "state",
        "subscriber",
        "event_type",
        "last_error_type",
        "attempts",
        ScheduledFilter,
        ("next_retry_at", admin.DateFieldListFilter),
    ]
    search_fields = ["aggregate_id"]
    search_help_text = gettext_lazy(
        "Delivery id, event id, aggregate id (exact) or words of the last error."
    )
    show_full_result_count = False
    actions = ["requeue_selected", "retry_now", "dead_letter_selected", "skip_selected"]
    readonly_fields = [
        "event_link",
        "state_label",
        "error_text",
        "traceback_text",
        "next_retry",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "event_link",
                    "subscriber",
                    "event_type",
                    "state_label",
                    "attempts",
                    "next_retry",
                    "deliver_at",
                    "completed_at",
                    "created_at",
                    "updated_at",
                ]
            },
        ),
        (
            gettext_lazy("Aggregate"),
            {
                "fields": [
                    "aggregate_type",
                    "aggregate_id",
                    "aggregate_version",
                    "tenant_id",
                ]
            },
        ),
        (
            gettext_lazy("Last error"),
            {
                "fields": [
                    "last_error_type",
                    "first_failed_at",
                    "error_text",
                    "traceback_text",
                ]
            },
        ),
        (
            gettext_lazy("Lease"),
            {"fields": ["locked_by", "locked_until", "lease_token"]},
        ),
    ]

    def get_queryset(self, request):
        """Each row says whether its subscriber is paused: by an outage of
        its destination (``outage``), or by an operator (``held``)."""
        return (
            super()
            .get_queryset(request)
            .annotate(
                outage=Exists(
                    SubscriberPause.objects.paused(database_now()).filter(
                        subscriber=OuterRef("subscriber")
                    )
                ),
                held=Exists(
                    Subscription.objects.filter(
                        subscriber=OuterRef("subscriber"), paused_at__isnull=False
                    )
                ),
            )
        )

    # --- columns and detail fields ---

    @admin.display(description=gettext_lazy("event"), ordering="event_id")
    def event_link(self, obj: Delivery):
        url = reverse(
            f"{self.admin_site.name}:outbox_app_outboxevent_change",
            args=[quote(obj.event_id)],
        )
        return format_html('<a href="{}">{}</a>', url, short_uuid(obj.event_id))

    @admin.display(description=gettext_lazy("subscriber"), ordering="subscriber")
    def subscriber_name(self, obj: Delivery):
        """May wrap after each dot of a dotted name (shop.<wbr>send_email)."""
        parts = obj.subscriber.split(".")
        return format_html_join(mark_safe(".<wbr>"), "{}", ((p,) for p in parts))

    @admin.display(description=gettext_lazy("state"), ordering="state")
    def state_label(self, obj: Delivery):
        """The coloured state and, once tried more than once, its attempts
        ("failed x2", with a multiplication sign)."""
        if obj.attempts < 2:
            return state_badge(obj.state)
        return format_html(
            '{} <span title="{}" style="white-space: nowrap">&times;{}</span>',
            state_badge(obj.state),
            _("attempts"),
            obj.attempts,
        )

    @admin.display(description=gettext_lazy("next try"), ordering="next_retry_at")
    def next_retry(self, obj: Delivery):
        return next_try(obj)

    @admin.display(description=gettext_lazy("last error"))
    def short_error(self, obj: Delivery):
        """The error's class name and the start of its message; the dotted
        type (what the filter and ``--error-type`` take) and the whole message
        are the title. The one column that wraps, so the list fits."""
        return error_summary(obj.last_error_type, obj.last_error)

    @admin.display(description=gettext_lazy("error"))
    def error_text(self, obj: Delivery):
        return pre(obj.last_error)

    @admin.display(description=gettext_lazy("traceback"))
    def traceback_text(self, obj: Delivery):
        return pre(obj.last_traceback)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        query = Q(aggregate_id=term) | error_words(term)
        if term.isdigit():
            query |= Q(pk=int(term))
        event_id = as_uuid(term)
        if event_id is not None:
            query |= Q(event_id=event_id)
        return queryset.filter(query), False

    # --- actions ---

    requeue_selected = _transition_action("requeue")
    retry_now = _transition_action("retry_now")
    dead_letter_selected = _transition_action("dead_letter")
    skip_selected = _transition_action("skip")

    def _transition(self, request, queryset, transition: str) -> None:
        """Apply ``transition`` to the rows of ``queryset`` it concerns; log
        them and say what happened (:data:`TRANSITIONS`)."""
        text = TRANSITIONS[transition]
        log, done, none = text["log"], text["done"], text["none"]
        selection = self._selection(request)
        logged = None
        if selection is not None and len(selection) <= LOG_EACH_MAX:
            logged = list(queryset.affected(transition).values_list("pk", flat=True))
        count = queryset.apply(transition)
        if count:
            self._log(request, Delivery, logged, count, log)
            skipped = len(selection) - count if selection is not None else 0
            said = done(count) % {"count": count}
            if skipped > 0:
                said += " " + ngettext(
                    "%(count)d selected delivery was left as it was.",
                    "%(count)d selected deliveries were left as they were.",
                    skipped,
                ) % {"count": skipped}
            self.message_user(request, said, messages.SUCCESS)
        else:
            self.message_user(request, none, messages.WARNING)

    def transition_view(self, request, object_id: str, transition: str):
        """POST from a delivery's page: one transition on that row (the
        buttons :meth:`change_view` shows), then back to the page."""
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.has_requeue_permission(request):
            raise PermissionDenied
        if transition not in TRANSITIONS:
            raise Http404(f"no transition {transition!r}")
        row = self.get_object(request, unquote(object_id))
        if row is None:
            raise Http404(f"no delivery {object_id!r}")
        self._transition(request, Delivery.objects.filter(pk=row.pk), transition)
        return HttpResponseRedirect(
            reverse(
                f"{self.admin_site.name}:outbox_app_delivery_change",
                args=[quote(row.pk)],
            )
        )

    def change_view(self, request, object_id, form_url="", extra_context=None):
        row = self.get_object(request, unquote(object_id))
        buttons = []
        if row is not None and self.has_requeue_permission(request):
            buttons = [
                {
                    "label": text["button"],
                    "title": text["action"],
                    "url": reverse(
                        f"{self.admin_site.name}:outbox_app_delivery_transition",
                        args=[quote(row.pk), name],
                    ),
                }
                for name, text in TRANSITIONS.items()
                if row.state in lifecycle.transition(name).sources
            ]
        extra_context = {**(extra_context or {}), "outbox_transitions": buttons}
        return super().change_view(request, object_id, form_url, extra_context)

    def get_fieldsets(self, request, obj=None):
        """The error fields are titled as the previous attempt's once the row
        moved on (requeued, retried, succeeded): kept as history, not current."""
        fieldsets = super().get_fieldsets(request, obj)
        if (
            obj is None
            or not obj.last_error
            or obj.state in CURRENT_ERROR_STATES
            or obj.last_error_type == LAPSED_ERROR_TYPE  # the reason it was skipped
        ):
            return fieldsets
        title = _("Previous attempt's error (kept as history)")
        return [
            (title if options["fields"][0] == "last_error_type" else name, options)
            for name, options in fieldsets
        ]

    # --- extra pages ---

    def get_urls(self):
        info = self.opts.app_label, self.opts.model_name
        wrap = self.admin_site.admin_view
        return [
            path(
                "requeue-matching/",
                wrap(self.requeue_matching_view),
                name="{}_{}_requeue_matching".format(*info),
            ),
            # The overview's first addresses, kept for bookmarks.
            path("overview/", wrap(_to_overview)),
            path(
                "<path:object_id>/transition/<str:transition>/",
                wrap(self.transition_view),
                name="{}_{}_transition".format(*info),
            ),
            path("overview.json", wrap(_to_overview_json)),
            *super().get_urls(),
        ]

    def changelist_view(self, request, extra_context=None):
        extra_context = {
            **(extra_context or {}),
            "has_requeue_permission": self.has_requeue_permission(request),
            "overview_url": reverse(f"{self.admin_site.name}:outbox_app_overview"),
            "requeue_matching_url": reverse(
                f"{self.admin_site.name}:outbox_app_delivery_requeue_matching"
            ),
        }
        return super().changelist_view(request, extra_context)

    def requeue_matching_view(self, request):
        """Requeue every failed or dead delivery the changelist's current
        filters and search select: a confirmation page (GET), then the requeue in
        batches (POST). The filters are the query string, as on the changelist."""
        if not self.has_requeue_permission(request):
            raise PermissionDenied
        changelist_url = reverse(
            f"{self.admin_site.name}:outbox_app_delivery_changelist"
        )
        query = request.GET.urlencode()
        back = f"{changelist_url}?{query}" if query else changelist_url
        try:
            changelist = self.get_changelist_instance(request)
        except IncorrectLookupParameters:
            self.message_user(request, _("Unknown filter."), messages.ERROR)
            return HttpResponseRedirect(changelist_url)
        matching = changelist.get_queryset(request)
        if request.method == "POST":
            count = matching.apply("requeue")
            if count:
                self._log(
                    request,
                    Delivery,
                    None,
                    count,
                    _(
                        "Requeued everything matching the filter: due now, "
                        "attempts reset."
                    ),
                )
                self.message_user(
                    request,
                    ngettext(
                        "%(count)d delivery was requeued.",
                        "%(count)d deliveries were requeued.",
                        count,
                    )
                    % {"count": count},
                    messages.SUCCESS,
                )
            else:
                self.message_user(
                    request,
                    _("Nothing was requeued: no failed or dead delivery matches."),
                    messages.WARNING,
                )
            return HttpResponseRedirect(back)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Requeue everything matching the filter"),
            "opts": self.opts,
            "requeueable": matching.apply("requeue", dry_run=True),
            "filters": _described(changelist, request),
            "changelist_back": back,
        }
        return TemplateResponse(
            request, "admin/outbox_app/delivery/requeue_matching.html", context
        )


#: Query parameters of a changelist that select nothing: ordering, search
#: (said apart), page, and the admin's own flags.
_NOT_FILTERS = {ORDER_VAR, SEARCH_VAR, PAGE_VAR, ERROR_FLAG, ALL_VAR, IS_FACETS_VAR}


def _described(changelist, request) -> list[tuple[str, str]]:
    """The changelist's filters and search in words: each sidebar filter by
    its title and chosen value, a lookup of the address that no sidebar
    filter takes (``subscriber__exact=...``, as the overview links) by its
    field's name: ``[("state", "dead"), ("subscriber", "shop.mailer"),
    ("search", "42")]``."""
    said = []
    taken = set(_NOT_FILTERS)
    for spec in changelist.filter_specs:
        taken.update(spec.expected_parameters())
        if not spec.used_parameters:
            continue
        chosen = [str(c["display"]) for c in spec.choices(changelist) if c["selected"]]
        said.append((str(spec.title), ", ".join(chosen)))
    opts = changelist.model._meta
    for key, values in request.GET.lists():
        if key in taken:
            continue
        name, _sep, lookup = key.partition("__")
        try:
            title = str(opts.get_field(name).verbose_name)
        except FieldDoesNotExist:
            title = name
        if lookup and lookup != "exact":
            title = f"{title} ({lookup.replace('__', ' ')})"
        said.append((title, ", ".join(values)))
    if changelist.query:
        said.append((_("search"), changelist.query))
    return said


def _to_overview(request):
    return HttpResponseRedirect(reverse("admin:outbox_app_overview"))


def _to_overview_json(request):
    return HttpResponseRedirect(reverse("admin:outbox_app_overview_json"))


@admin.register(Notification)
class LegacyNotificationAdmin(admin.ModelAdmin):
    """Redirects the former addresses, ``/admin/outbox_app/notification/...``,
    to the same page under ``delivery/`` (301, query string kept). Not on the
    admin index; the target page checks the permissions."""

    def get_model_perms(self, request) -> dict[str, bool]:
        return {}

    def get_urls(self):
        return [
            path("", self.admin_site.admin_view(self.redirect)),
            path("<path:rest>", self.admin_site.admin_view(self.redirect)),
        ]

    def redirect(self, request, rest: str = "") -> HttpResponsePermanentRedirect:
        target = reverse(f"{self.admin_site.name}:outbox_app_delivery_changelist")
        target += rest
        query = request.META.get("QUERY_STRING")
        return HttpResponsePermanentRedirect(f"{target}?{query}" if query else target)
