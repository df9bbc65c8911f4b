"""The outbox overview page: counts, lag, dead and blocked rows per
subscriber, the deliveries-per-minute chart, and the inbox's messages per
consumer; served by its own admin."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from django.contrib import admin, messages
from django.contrib.auth import get_permission_codename
from django.core.exceptions import ImproperlyConfigured, PermissionDenied
from django.http import HttpResponse, JsonResponse
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.translation import gettext as _

from ..conf import mask_url
from ..exceptions import OutboxError
from ..ops import status
from ..store.lifecycle import InboxState, State
from ..store.models import Delivery, OutboxOverview
from ..templatetags.outbox_admin import chart_hours
from .base import ReadOnly

#: Seconds between two refreshes of the overview's live part (its counts,
#: lag, warnings and tables) in the browser.
REFRESH_SECONDS = 5


def _display_row(row: dict[str, Any]) -> dict[str, Any]:
    """A subscriber's counts, each with the deliveries list's filter for it."""
    return {
        **row,
        "state_cells": [
            (
                row["states"][state],
                urlencode({"subscriber__exact": row["name"], "state__exact": state}),
            )
            for state in State.values
        ],
        "filter_query": urlencode(
            {"subscriber__exact": row["name"], "state__exact": State.DEAD}
        ),
    }


def _inbox_row(row: dict[str, Any]) -> dict[str, Any]:
    """A consumer's inbox counts, each with the inbox list's filter for it."""
    return {
        **row,
        "cells": [
            (
                row["states"][state],
                urlencode({"consumer__exact": row["consumer"], "state__exact": state}),
            )
            for state in InboxState.values
        ],
        "dead": row["states"][InboxState.DEAD],
    }


class OverviewAdmin(ReadOnly, admin.ModelAdmin):
    """The outbox overview, listed as "Overview" under Outbox on the admin
    index (a proxy model, ``OutboxOverview``, is the index's way to list a
    page): its address, ``/admin/outbox_app/outboxoverview/``, is the page,
    and ``overview.json`` beside it the same numbers as JSON."""

    def has_module_permission(self, request) -> bool:
        return self.has_view_permission(request)

    def has_view_permission(self, request, obj=None) -> bool:
        opts = Delivery._meta
        return any(
            request.user.has_perm(
                f"{opts.app_label}.{get_permission_codename(perm, opts)}"
            )
            for perm in ("view", "change")
        )

    def get_urls(self):
        wrap = self.admin_site.admin_view
        return [
            path("", wrap(self.overview_view), name="outbox_app_overview"),
            path(
                "overview.json",
                wrap(self.overview_json_view),
                name="outbox_app_overview_json",
            ),
            path("live/", wrap(self.live_view), name="outbox_app_overview_live"),
            *super().get_urls(),
        ]

    def _context(self, data: dict[str, Any] | None) -> dict[str, Any]:
        """What the page and its live part show of ``data``
        (:func:`~outbox_app.ops.status.overview`'s)."""
        name = self.admin_site.name
        return {
            "data": data,
            "rows": [_display_row(row) for row in data["subscribers"]] if data else [],
            # One column per state, headers and cells from the same list.
            "state_labels": State.labels,
            "inbox_rows": [_inbox_row(row) for row in data["inbox"]] if data else [],
            "inbox_labels": InboxState.labels,
            "inbox_url": reverse(f"{name}:outbox_app_inboxmessage_changelist"),
            "changelist_url": reverse(f"{name}:outbox_app_delivery_changelist"),
            "events_url": reverse(f"{name}:outbox_app_outboxevent_changelist"),
            "refresh_seconds": REFRESH_SECONDS,
        }

    def overview_view(self, request):
        """The outbox overview: per subscriber counts, lag, dead and blocked
        rows, and a chart of deliveries per minute over 24 hours; its live
        part is fetched again every :data:`REFRESH_SECONDS` by
        ``outbox_app/overview.js``."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            data = status.overview()
        except (OutboxError, ImproperlyConfigured) as exc:
            self.message_user(request, mask_url(str(exc)), messages.ERROR)
            data = None
        context = self._context(data)
        context.update(
            self.admin_site.each_context(request),
            title=_("Outbox overview"),
            opts=self.opts,
            hours=data
            and chart_hours(data["deliveries"]["per_minute"], request.GET.get("hours")),
            json_url=reverse(f"{self.admin_site.name}:outbox_app_overview_json"),
            live_url=reverse(f"{self.admin_site.name}:outbox_app_overview_live"),
        )
        return TemplateResponse(request, "admin/outbox_app/overview.html", context)

    def live_view(self, request):
        """The overview's live part alone (counts, lag, warnings, the
        subscribers' and the inbox's tables), HTML for the page to put in
        place; without the 24 hours' chart, which is not read again."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        try:
            data = status.overview(deliveries=False)
        except (OutboxError, ImproperlyConfigured) as exc:
            # The page keeps what it shows and says the refresh failed.
            text = mask_url(str(exc))
            return HttpResponse(text, status=503, content_type="text/plain")
        return TemplateResponse(
            request, "admin/outbox_app/overview_live.html", self._context(data)
        )

    def overview_json_view(self, request):
        """The overview's numbers as JSON (:func:`outbox_app.ops.status.overview`)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        return JsonResponse(status.overview())


admin.site.register(OutboxOverview, OverviewAdmin)
