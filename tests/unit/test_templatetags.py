"""The admin pages' template tags (templatetags/outbox_admin.py): durations as
an operator reads them, and the deliveries-per-minute chart's geometry."""

from __future__ import annotations

import pytest

from outbox_app.templatetags.outbox_admin import (
    CHART_RANGES,
    chart,
    chart_hours,
    duration,
)


@pytest.mark.parametrize(
    ("seconds", "shown"),
    [
        (None, "-"),
        (0, "0 s"),
        (12.9, "12 s"),
        (60, "1 min 0 s"),
        (3725, "1 h 2 min"),
        (47 * 3600 + 59 * 60, "47 h 59 min"),
        (49 * 3600, "2 d 1 h"),
    ],
)
def test_duration(seconds, shown):
    assert duration(seconds) == shown


def test_the_range_is_the_one_asked_for_or_the_shortest_that_holds_the_activity():
    day = [0] * 1440
    assert chart_hours(day, "6") == 6
    assert chart_hours(day, "5") == 1  # not a range: chosen as if not asked
    assert chart_hours(day, None) == 1  # nothing delivered
    assert chart_hours([*day[:-30], *[1] * 30], None) == 1
    assert chart_hours([*day[:-300], *[1] * 300], None) == 6
    assert chart_hours([1, *day[1:]], None) == 24


@pytest.mark.parametrize("hours", sorted(CHART_RANGES))
def test_one_bar_per_busy_minute_scaled_to_the_peak(hours):
    per_minute = [0] * 1440
    per_minute[-1], per_minute[-2] = 10, 5
    drawn = chart({"per_minute": per_minute, "end": "2026-01-01T12:00:00+00:00"}, hours)
    bars = drawn["bars"].split("M")[1:]
    assert len(bars) == 2
    # The peak reaches the top of the plot, half the peak half as high.
    heights = [float(b.split("V")[0].split()[1]) - float(b.split("V")[1]) for b in bars]
    assert heights[1] == pytest.approx(2 * heights[0], abs=0.2)
    assert drawn["ticks"][-1]["label"] == "12:00"


@pytest.mark.parametrize(
    ("peak", "labels"),
    [
        (0, [0, 1, 2]),
        (1, [0, 1, 2]),  # it read 0, 0, 1 (bottom to top): "1 / 0 / 0"
        (3, [0, 2, 4]),
        (7, [0, 5, 10]),
        (368, [0, 200, 400]),
        (1827, [0, 1000, 2000]),
    ],
)
def test_the_scale_reads_as_three_distinct_round_numbers(peak, labels):
    per_minute = [0] * 1440
    per_minute[-1] = peak
    drawn = chart({"per_minute": per_minute, "end": "2026-01-01T12:00:00+00:00"}, 1)
    assert [level["label"] for level in drawn["levels"]] == labels
    if peak:  # the busiest minute's bar stays inside the plot
        top = float(drawn["bars"].split("V")[1])
        assert top >= drawn["top"] - 0.1


def test_every_peak_gets_distinct_whole_labels_above_it():
    end = "2026-01-01T12:00:00+00:00"
    for peak in range(0, 5001):
        drawn = chart({"per_minute": [0] * 59 + [peak], "end": end}, 1)
        labels = [level["label"] for level in drawn["levels"]]
        assert len(set(labels)) == 3 and labels[-1] >= peak, (peak, labels)
