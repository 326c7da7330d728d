"""PNG plots next to results.json (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def line_plot(path: str | Path, series: dict[str, list[float]], xlabel: str, ylabel: str,
              title: str, log: bool = False) -> Path:
    """One line per series over x = 0, 1, 2, ... (e.g. layers)."""
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, ys in series.items():
        axes.plot(range(len(ys)), ys, marker="o", markersize=3, label=name)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if log:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


def scatter_lines(path: str | Path, series: dict[str, list[tuple[float, float]]], xlabel: str,
                  ylabel: str, title: str, log: bool = False) -> Path:
    """One line of (x, y) points per series, sorted by x (e.g. a bit-rate Pareto curve)."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        axes.plot(xs, ys, marker="o", label=name)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if log:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)
