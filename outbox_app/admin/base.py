"""The admin's shared pieces: a read-only base with the requeue permission and
the admin log, and how values are shown (JSON, text, states, ids, durations)."""

from __future__ import annotations

import json
import uuid
from typing import Any

from django.contrib.admin import helpers
from django.contrib.admin.models import CHANGE, LogEntry
from django.contrib.auth import get_permission_codename
from django.contrib.contenttypes.models import ContentType
from django.db.models import Q
from django.http import (
    HttpRequest,
)
from django.utils.html import format_html
from django.utils.text import Truncator, smart_split, unescape_string_literal

from ..store.lifecycle import State
from ..store.models import Delivery

#: An action logs one LogEntry per row up to this many selected rows; beyond
#: (or with "select all"), one LogEntry for the whole operation.
LOG_EACH_MAX = 500


def pretty_json(value: Any):
    """JSON indented in a <pre>, escaped (an event's payload is untrusted)."""
    if value is None:
        return "-"
    text = json.dumps(value, indent=2, ensure_ascii=False, sort_keys=True)
    return format_html('<pre class="outbox-json">{}</pre>', text)


#: A colour per state, so a failure stands out in a list (Django admin's own
#: palette where it has one: --error-fg for dead).
STATE_COLOURS = {
    State.PENDING: "var(--body-quiet-color, #666)",
    State.RUNNING: "var(--link-fg, #447e9b)",
    State.SUCCEEDED: "#2e7d32",
    State.FAILED: "#b35c00",
    State.DEAD: "var(--error-fg, #ba2121)",
    State.SKIPPED: "var(--body-quiet-color, #666)",
}


def state_badge(state: str):
    """A state as a coloured, bold label ("● dead")."""
    return format_html(
        '<span class="outbox-state outbox-state-{}" style="color: {}; '
        'font-weight: 600; white-space: nowrap">● {}</span>',
        state.lower(),
        STATE_COLOURS.get(state, "inherit"),
        State(state).label,
    )


def error_summary(error_type: str, error: str):
    """A list cell: the error's class name and the start of its message; the
    dotted type (what the filters and ``--error-type`` take) and the whole
    message are the title. "-" when there is none."""
    if not error:
        return "-"
    return format_html(
        '<span title="{}: {}"><strong>{}</strong> {}</span>',
        error_type,
        error,
        error_type.rsplit(".", 1)[-1],
        Truncator(error).chars(90),
    )


def short_uuid(value: Any):
    """A UUIDv7 by its tail: the leading (time) digits repeat from row to row,
    the last 8 (random) tell the rows of a page apart. The full id is the
    title; one line."""
    text = str(value)
    return format_html(
        '<span title="{}" style="white-space: nowrap">…{}</span>', text, text[-8:]
    )


def pre(text: str):
    if not text:
        return "-"
    return format_html('<pre class="outbox-text">{}</pre>', text)


def error_words(term: str) -> Q:
    """Rows whose ``last_error`` holds every word of ``term``, in any case and
    order ("quoted words" as one), as Django's admin search reads a term: how
    the deliveries' and the inbox's lists search "words of the last error"."""
    query = Q()
    for word in smart_split(term):
        if word[0] in "\"'" and word[0] == word[-1] and len(word) > 1:
            word = unescape_string_literal(word)
        query &= Q(last_error__icontains=word)
    return query


class ReadOnly:
    """Nobody adds, changes or deletes outbox rows in the admin: rows change
    state only through the transitions, and ``outbox_purge`` deletes them."""

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False


class OutboxAdminBase(ReadOnly):
    """Read-only pages plus the requeue permission and the admin log; lists
    whose long words wrap (``static/outbox_app/admin.css``)."""

    class Media:
        css = {"all": ["outbox_app/admin.css"]}

    def has_requeue_permission(self, request: HttpRequest) -> bool:
        """``outbox_app.requeue_delivery``: requeue, retry, dead-letter, replay."""
        opts = Delivery._meta
        codename = get_permission_codename("requeue", opts)
        return request.user.has_perm(f"{opts.app_label}.{codename}")

    def _selection(self, request: HttpRequest) -> list[str] | None:
        """The explicitly ticked primary keys, or None for "select all N"."""
        if request.POST.get("select_across") in ("1", "True", "true", "on"):
            return None
        return request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)

    def _log(
        self,
        request: HttpRequest,
        model,
        ids: list | None,
        count: int,
        message: str,
    ) -> None:
        """Record an operation in the admin log: one entry per row for a small
        explicit selection, else one entry describing the whole operation."""
        if ids is not None and len(ids) <= LOG_EACH_MAX:
            if ids:
                LogEntry.objects.log_actions(
                    user_id=request.user.pk,
                    queryset=model._default_manager.filter(pk__in=ids),
                    action_flag=CHANGE,
                    change_message=message,
                )
            return
        filters = request.GET.urlencode()
        opts = model._meta
        name = opts.verbose_name if count == 1 else opts.verbose_name_plural
        what = f"{count} {name}"
        LogEntry.objects.create(
            user_id=request.user.pk,
            content_type_id=ContentType.objects.get_for_model(model).pk,
            object_id=None,
            object_repr=(f"{what} ({filters})" if filters else what)[:200],
            action_flag=CHANGE,
            change_message=message,
        )


def as_uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None
