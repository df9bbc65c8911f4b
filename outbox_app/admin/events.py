"""The outbox events' admin: the list with each event's deliveries, an event's
page with its deliveries, "requeue deliveries" and "replay to subscriber"."""

from __future__ import annotations

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import ImproperlyConfigured
from django.db.models import Count, OuterRef, Q, Subquery, Value
from django.db.models.functions import Coalesce
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import lazy
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.utils.text import Truncator
from django.utils.translation import gettext as _
from django.utils.translation import gettext_lazy, ngettext

from ..exceptions import OutboxError
from ..ops import streams
from ..ops import subscriptions as operations
from ..store.clock import database_now
from ..store.lifecycle import State
from ..store.models import Delivery, OutboxEvent
from .base import (
    STATE_COLOURS,
    OutboxAdminBase,
    ReadOnly,
    as_uuid,
    pretty_json,
    short_uuid,
)
from .deliveries import next_try


class DeliveryInline(ReadOnly, admin.TabularInline):
    """An event's deliveries, read-only, on the event's page."""

    model = Delivery
    fields = [
        "subscriber",
        "state",
        "attempts",
        "next_retry",
        "last_error_type",
        "short_error",
        "completed_at",
    ]
    readonly_fields = fields
    ordering = ["subscriber"]
    extra = 0
    can_delete = False
    show_change_link = True

    @admin.display(description=gettext_lazy("last error"))
    def short_error(self, obj: Delivery) -> str:
        return Truncator(obj.last_error).chars(120)

    @admin.display(description=gettext_lazy("next try"))
    def next_retry(self, obj: Delivery):
        """Nothing for a finished row (its ``next_retry_at`` is stale)."""
        return next_try(obj)


def _deliveries(state: State):
    rows = (
        Delivery.objects.filter(event=OuterRef("pk"), state=state)
        .order_by()
        .values("event")
        .annotate(n=Count("pk"))
        .values("n")
    )
    return Coalesce(Subquery(rows), Value(0))


class ScheduleFilter(admin.SimpleListFilter):
    """Events scheduled for later (``publish(deliver_at=...)``), and events
    with an expiry (``expires_at``)."""

    title = gettext_lazy("schedule")
    parameter_name = "schedule"

    def lookups(self, request, model_admin):
        return [
            ("scheduled", _("scheduled for later")),
            ("expiring", _("with an expiry")),
            ("expired", _("expiry passed")),
        ]

    def queryset(self, request, queryset):
        now = database_now(queryset.db)
        if self.value() == "scheduled":
            return queryset.filter(deliver_at__gt=now)
        if self.value() == "expiring":
            return queryset.filter(expires_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(expires_at__lte=now)
        return queryset


class ReplayForm(forms.Form):
    subscriber = forms.ChoiceField(label=gettext_lazy("Subscriber"))

    def __init__(self, *args, choices, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["subscriber"].choices = choices


def _deliveries_header() -> str:
    """The deliveries column's header and its legend, on two lines: a header
    does not wrap, and the legend on one line pushed the list past 1400 px."""
    return format_html(
        '{}<br><small class="outbox-legend" style="white-space: normal" '
        'title="{}">{}</small>',
        _("deliveries"),
        _("Deliveries of the event: succeeded / failed / dead"),
        _("succeeded / failed / dead"),
    )


DELIVERIES_HEADER = lazy(_deliveries_header, SafeString)()


@admin.register(OutboxEvent)
class OutboxEventAdmin(OutboxAdminBase, admin.ModelAdmin):
    list_display = [
        "short_id",
        "type_or_action",
        "aggregate",
        "occurred_at",
        "fanned_out",
        "delivery_summary",
    ]
    list_filter = [
        "event_type",
        "aggregate_type",
        "tenant_id",
        "fanned_out",
        ScheduleFilter,
        ("occurred_at", admin.DateFieldListFilter),
    ]
    search_fields = ["aggregate_id"]
    search_help_text = gettext_lazy(
        "Event id, action id, aggregate id or correlation id (exact)."
    )
    show_full_result_count = False
    list_display_links = ["short_id"]
    actions = ["requeue_deliveries", "replay_to_subscriber"]
    inlines = [DeliveryInline]
    readonly_fields = [
        "payload_pretty",
        "headers_pretty",
        "action_params_pretty",
        "delivered_to",
    ]
    fieldsets = [
        (
            None,
            {
                "fields": [
                    "id",
                    "namespace",
                    "event_type",
                    "revision",
                    "occurred_at",
                    "created_at",
                    "fanned_out",
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
        (gettext_lazy("Schedule"), {"fields": ["deliver_at", "expires_at"]}),
        (gettext_lazy("Deliveries"), {"fields": ["delivered_to"]}),
        (gettext_lazy("Payload"), {"fields": ["payload_pretty", "headers_pretty"]}),
        (
            gettext_lazy("Action"),
            {"fields": ["action_id", "action_name", "action_params_pretty"]},
        ),
    ]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .annotate(
                n_succeeded=_deliveries(State.SUCCEEDED),
                n_failed=_deliveries(State.FAILED),
                n_dead=_deliveries(State.DEAD),
            )
        )

    def changelist_view(self, request, extra_context=None):
        extra_context = {
            **(extra_context or {}),
            "overview_url": reverse(f"{self.admin_site.name}:outbox_app_overview"),
        }
        return super().changelist_view(request, extra_context)

    # --- columns and detail fields ---

    @admin.display(description=gettext_lazy("id"), ordering="id")
    def short_id(self, obj: OutboxEvent):
        return short_uuid(obj.id)

    @admin.display(description=gettext_lazy("event type"), ordering="event_type")
    def type_or_action(self, obj: OutboxEvent) -> str:
        if obj.is_sentinel:
            return _("(nothing published by action %(name)s)") % {
                "name": obj.action_name
            }
        return obj.event_type

    @admin.display(description=gettext_lazy("aggregate"))
    def aggregate(self, obj: OutboxEvent) -> str:
        if obj.aggregate_type is None:
            return "-"
        version = "" if obj.aggregate_version is None else f" v{obj.aggregate_version}"
        return f"{obj.aggregate_type}:{obj.aggregate_id}{version}"

    @admin.display(description=DELIVERIES_HEADER)
    def delivery_summary(self, obj: OutboxEvent):
        """succeeded / failed / dead, each in its state's colour when not
        zero; the header is the legend, and the cell's title says it again
        with the numbers."""
        counts = [
            (State.SUCCEEDED, obj.n_succeeded),
            (State.FAILED, obj.n_failed),
            (State.DEAD, obj.n_dead),
        ]
        parts = format_html_join(
            " / ",
            '<span style="color: {}">{}</span>',
            ((STATE_COLOURS[s] if n else "inherit", n) for s, n in counts),
        )
        return format_html(
            '<span title="{}" style="white-space: nowrap">{}</span>',
            _("%(succeeded)d succeeded, %(failed)d failed, %(dead)d dead")
            % {
                "succeeded": obj.n_succeeded,
                "failed": obj.n_failed,
                "dead": obj.n_dead,
            },
            parts,
        )

    @admin.display(description=gettext_lazy("payload"))
    def payload_pretty(self, obj: OutboxEvent):
        return pretty_json(obj.payload)

    @admin.display(description=gettext_lazy("by subscriber"))
    def delivered_to(self, obj: OutboxEvent):
        """Each subscriber's delivery of the event: its row's state, or by
        stream delivery "delivered" once its cursor read past it, "waiting"
        before (:func:`outbox_app.ops.streams.event_deliveries`)."""
        found = streams.event_deliveries(obj, obj._state.db)
        if not found:
            return _("none")
        rows = Delivery.objects.using(obj._state.db).filter(event_id=obj.pk)
        with_rows = set(rows.values_list("subscriber", flat=True))
        return format_html_join(
            "",
            "<div>{}: {}</div>",
            (
                (
                    name,
                    state.lower()
                    if name in with_rows
                    else (
                        _("delivered (its stream read past it)")
                        if state == State.SUCCEEDED
                        else _("waiting in its stream")
                    ),
                )
                for name, state in sorted(found.items())
            ),
        )

    @admin.display(description=gettext_lazy("headers"))
    def headers_pretty(self, obj: OutboxEvent):
        return pretty_json(obj.headers)

    @admin.display(description=gettext_lazy("action parameters"))
    def action_params_pretty(self, obj: OutboxEvent):
        return pretty_json(obj.action_params)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        query = Q(aggregate_id=term) | Q(headers__correlation_id=term)
        uuid = as_uuid(term)
        if uuid is not None:
            query |= Q(pk=uuid) | Q(action_id=uuid)
        return queryset.filter(query), False

    # --- actions ---

    @admin.action(
        permissions=["requeue"],
        description=gettext_lazy("Requeue all failed or dead deliveries of this event"),
    )
    def requeue_deliveries(self, request, queryset):
        count = Delivery.objects.using(queryset.db).of_events(queryset).requeue()
        if not count:
            self.message_user(
                request,
                _(
                    "Nothing was requeued: these events have no failed or "
                    "dead delivery."
                ),
                messages.WARNING,
            )
            return
        self._log(
            request,
            OutboxEvent,
            self._selection(request),
            count,
            _("Requeued the failed and dead deliveries of this event."),
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

    @admin.action(
        permissions=["requeue"], description=gettext_lazy("Replay to subscriber…")
    )
    def replay_to_subscriber(self, request, queryset):
        """An intermediate page chooses the subscriber; its delivery of each
        selected event is created, or reset to PENDING."""
        try:
            choices = operations.subscriber_choices()
        except ImproperlyConfigured as exc:
            self.message_user(request, str(exc), messages.ERROR)
            return None
        if not choices:
            self.message_user(
                request,
                _(
                    "No handler or publisher is configured: there is nobody "
                    "to replay to."
                ),
                messages.WARNING,
            )
            return None
        applying = "apply" in request.POST
        form = ReplayForm(request.POST if applying else None, choices=choices)
        if applying and form.is_valid():
            name = form.cleaned_data["subscriber"]
            try:
                result = operations.replay_to(queryset, name)
            except OutboxError as exc:
                self.message_user(request, str(exc), messages.ERROR)
                return None
            self._log(
                request,
                OutboxEvent,
                self._selection(request),
                result.queued,
                _("Replayed to subscriber %(name)s.") % {"name": name},
            )
            text = ngettext(
                "%(count)d delivery to %(name)s is due now",
                "%(count)d deliveries to %(name)s are due now",
                result.queued,
            ) % {"count": result.queued, "name": name}
            text += " " + _(
                "(%(created)d new, %(reset)d reset, %(skipped)d skipped)."
            ) % {
                "created": result.created,
                "reset": result.reset,
                "skipped": result.skipped,
            }
            level = messages.SUCCESS if result.queued else messages.WARNING
            self.message_user(request, text, level)
            return None
        selection = self._selection(request)
        context = {
            **self.admin_site.each_context(request),
            "title": _("Replay to a subscriber"),
            "opts": self.opts,
            "form": form,
            "count": queryset.count(),
            "preview": queryset.only("id", "event_type", "action_name")[:20],
            "selected": selection or [],
            "select_across": selection is None,
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "action": "replay_to_subscriber",
        }
        return TemplateResponse(
            request, "admin/outbox_app/outboxevent/replay.html", context
        )
