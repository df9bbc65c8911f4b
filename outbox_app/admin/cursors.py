"""The cursors' admin: stream delivery's place of each subscriber in the
outbox, per partition, what it has still to read and which relay holds it.
Read-only: a cursor moves only as its relay delivers (or an operator's
retire, reactivate or replay moves it, through their own pages)."""

from __future__ import annotations

from django.contrib import admin
from django.utils.translation import gettext_lazy

from ..ops import streams
from ..store.models import Cursor
from ..templatetags.outbox_admin import duration
from .base import OutboxAdminBase


@admin.register(Cursor)
class CursorAdmin(OutboxAdminBase, admin.ModelAdmin):
    list_display = [
        "subscriber",
        "slice",
        "waiting",
        "oldest_waiting",
        "held_by",
        "last_tick",
    ]
    list_filter = ["subscriber", "partitions"]
    search_fields = ["subscriber", "locked_by"]
    search_help_text = gettext_lazy("Subscriber or relay (part of its name).")
    ordering = ["subscriber", "partitions", "partition"]
    fields = [
        "subscriber",
        "partition",
        "partitions",
        "tick",
        "next_tick",
        "position",
        "stop_tick",
        "locked_by",
        "locked_until",
        "wanted_by",
        "ticked_at",
        "first_tick",
        "first_position",
        "created_at",
        "updated_at",
    ]

    def changelist_view(self, request, extra_context=None):
        # What each cursor has still to read: one query for every cursor.
        self._lag = {c["id"]: c for c in streams.lag(self._using(request))}
        return super().changelist_view(request, extra_context)

    def _using(self, request) -> str:
        return self.get_queryset(request).db

    def _of(self, obj: Cursor) -> dict:
        return getattr(self, "_lag", {}).get(obj.id, {})

    @admin.display(description=gettext_lazy("partition"))
    def slice(self, obj: Cursor) -> str:
        return f"{obj.partition + 1} of {obj.partitions}"

    @admin.display(description=gettext_lazy("waiting"))
    def waiting(self, obj: Cursor) -> int | str:
        """Events it has still to read (of its subscriber's types)."""
        return self._of(obj).get("waiting", "-")

    @admin.display(description=gettext_lazy("oldest waiting"))
    def oldest_waiting(self, obj: Cursor) -> str:
        seconds = self._of(obj).get("oldest_waiting_seconds")
        return "-" if seconds is None else duration(seconds)

    @admin.display(description=gettext_lazy("held by"))
    def held_by(self, obj: Cursor) -> str:
        return self._of(obj).get("held_by") or gettext_lazy("no relay")

    @admin.display(description=gettext_lazy("last tick"), ordering="ticked_at")
    def last_tick(self, obj: Cursor) -> str:
        seconds = self._of(obj).get("last_tick_seconds")
        return "-" if seconds is None else duration(seconds)
