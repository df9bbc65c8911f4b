"""Template tags of the outbox admin's pages: ``{{ seconds|duration }}`` and
``{% outbox_chart deliveries hours %}`` (the overview's deliveries-per-minute
chart, inline SVG). ``{% load outbox_admin %}``."""

from __future__ import annotations

import datetime
import itertools
from typing import Any

from django import template

register = template.Library()


@register.filter
def duration(seconds: float | None) -> str:
    """12.5 -> "12 s", 3725 -> "1 h 2 min"; None -> "-"."""
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


@register.inclusion_tag("admin/outbox_app/chart.html")
def outbox_chart(deliveries: dict[str, Any], hours: int) -> dict[str, Any]:
    """The deliveries-per-minute chart of ``status.deliveries_per_minute()``'s
    result over the last ``hours`` (one of :data:`CHART_RANGES`)."""
    return {"chart": chart(deliveries, hours)}


#: The chart's drawing: the SVG's viewBox units.
_CHART = {"width": 960, "height": 240, "left": 48, "right": 24, "top": 12, "bottom": 28}


#: The chart's ranges, in hours, and the minutes between its time ticks.
CHART_RANGES = {1: 10, 6: 60, 24: 180}


def chart_hours(per_minute: list[int], asked: str | None) -> int:
    """The range the operator asked for (``?hours=``), else the shortest that
    holds all of the last 24 hours' deliveries: recent activity fills the
    chart instead of a sliver at its right edge."""
    if asked and asked.isdigit() and int(asked) in CHART_RANGES:
        return int(asked)
    first = next((i for i, n in enumerate(per_minute) if n), len(per_minute))
    active = len(per_minute) - first
    return next(h for h in sorted(CHART_RANGES) if active <= h * 60 or h == 24)


def scale_top(peak: int) -> int:
    """The top of the chart's scale for a busiest minute of ``peak``
    deliveries: the smallest 2, 4, 10, 20, 40, 100, ... (twice 1, 2 or 5 times
    a power of ten) at or above it, so the scale's three labels, 0, half and
    top, are distinct whole numbers (a peak of 1 once read "1 / 0 / 0")."""
    step, factors = 1, itertools.cycle((2, 2.5, 2))  # 1, 2, 5, 10, 20, 50, ...
    while 2 * step < peak:
        step = round(step * next(factors))
    return 2 * step


def chart(deliveries: dict[str, Any], hours: int = 24) -> dict[str, Any]:
    """Geometry of the deliveries-per-minute chart over the last ``hours``: one
    bar per minute, a scale from 0 to :func:`scale_top` of the peak, time
    ticks (UTC) spaced for the range. Only numbers, so the SVG needs no
    escaping."""
    per_minute = deliveries["per_minute"][-hours * 60 :]
    scale = scale_top(max(per_minute))
    left, top = _CHART["left"], _CHART["top"]
    plot_w = _CHART["width"] - left - _CHART["right"]
    plot_h = _CHART["height"] - top - _CHART["bottom"]
    base = top + plot_h
    step = plot_w / len(per_minute)
    bars = " ".join(
        f"M{left + (i + 0.5) * step:.2f} {base}V{base - n / scale * plot_h:.1f}"
        for i, n in enumerate(per_minute)
        if n
    )
    end = datetime.datetime.fromisoformat(deliveries["end"])
    start = end - datetime.timedelta(minutes=len(per_minute))
    ticks = []
    for minute in range(0, len(per_minute) + 1, CHART_RANGES[hours]):
        moment = start + datetime.timedelta(minutes=minute)
        ticks.append({"x": round(left + minute * step, 1), "label": f"{moment:%H:%M}"})
    levels = [
        {"y": round(base - fraction * plot_h, 1), "label": int(scale * fraction)}
        for fraction in (0, 0.5, 1)
    ]
    return {
        **_CHART,
        "plot_right": left + plot_w,
        "base": base,
        "label_y": base + 18,
        "bar_width": round(step, 3),
        "bars": bars,
        "ticks": ticks,
        "levels": levels,
        "total": sum(per_minute),
        "peak": max(per_minute),
        "hours": hours,
        "ranges": list(CHART_RANGES),
    }
