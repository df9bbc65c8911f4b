"""One PNG per benchmark: grouped bars, matplotlib's ``Agg`` backend."""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def bars(
    name: str,
    title: str,
    ylabel: str,
    groups: list[str],
    series: dict[str, list[float]],
    log: bool = False,
) -> Path:
    """Save grouped bars as ``bench/<name>.png``.

    Args:
        name: file name without extension, relative to ``bench/`` or absolute.
        title: chart title.
        ylabel: y axis label, with its unit.
        groups: one label per group on the x axis.
        series: legend label -> one value per group.
        log: log-scale y axis.

    Returns:
        The path written.
    """
    path = Path(__file__).parent / f"{name}.png"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.8 / max(len(series), 1)
    for i, (label, values) in enumerate(series.items()):
        xs = [g + i * width for g in range(len(groups))]
        drawn = ax.bar(xs, values, width, label=label)
        ax.bar_label(drawn, labels=[_figure(v) for v in values], fontsize=7)
    ax.set_xticks([g + width * (len(series) - 1) / 2 for g in range(len(groups))])
    ax.set_xticklabels([textwrap.fill(group, 18) for group in groups], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if log:
        ax.set_yscale("log")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _figure(value: float) -> str:
    """1,234 or 12.3 or 0.97: three significant digits, thousands separated."""
    if abs(value) >= 100:
        return f"{value:,.0f}"
    return f"{value:.3g}"


def timeline(
    name: str,
    title: str,
    seconds: list[float],
    series: dict[str, list[float]],
    shaded: tuple[float, float] | None = None,
    shaded_label: str = "",
) -> Path:
    """Save lines over time as ``bench/<name>.png``.

    Args:
        name: file name without extension, relative to ``bench/`` or absolute.
        title: chart title.
        seconds: the x values, in seconds.
        series: legend label -> one value per x.
        shaded: an interval of x to shade (an outage, say), and its legend label.

    Returns:
        The path written.
    """
    path = Path(__file__).parent / f"{name}.png"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    if shaded is not None:
        ax.axvspan(*shaded, color="0.9", label=shaded_label)
    for label, values in series.items():
        ax.plot(seconds, values, label=label)
    ax.set_xlabel("seconds")
    ax.set_ylabel("rows")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
