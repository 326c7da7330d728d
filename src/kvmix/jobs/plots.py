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
    return _save(figure, path)


def scatter_lines(path: str | Path, series: dict[str, list[tuple[float, float]]], xlabel: str,
                  ylabel: str, title: str, log: bool = False,
                  marks: dict[str, tuple[float, float]] | None = None) -> Path:
    """One line of (x, y) points per series, sorted by x (e.g. a bit-rate Pareto curve); a
    star at a series' point in ``marks``."""
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for name, points in series.items():
        xs, ys = zip(*sorted(points), strict=True)
        line = axes.plot(xs, ys, marker="o", label=name)[0]
        if marks and name in marks:
            axes.plot(*marks[name], marker="*", markersize=16, color=line.get_color())
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    if log:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend()
    return _save(figure, path)


def grouped_bars(path: str | Path, panels: dict[str, dict[str, list[float]]], xlabel: str,
                 title: str, ticks: list[str] | None = None) -> Path:
    """One panel per entry, each with side-by-side bars per series over x = 0, 1, 2, ...
    (or over ``ticks``)."""
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (name, series) in zip(axes[:, 0], panels.items(), strict=True):
        width = 0.8 / len(series)
        for i, (label, ys) in enumerate(series.items()):
            ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(ys))], ys,
                   width=width, label=label)
        ax.set(ylabel=name)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8)
    if ticks:
        for ax in axes[:, 0]:
            ax.set_xticks(range(len(ticks)), ticks, rotation=30, ha="right", fontsize=8)
    axes[-1, 0].set(xlabel=xlabel)
    figure.suptitle(title)
    return _save(figure, path)


def capacity_plot(path: str | Path, series: dict[str, list[tuple[float, float]]],
                  capacity: float, title: str, device: str) -> Path:
    """Memory (GB) against generated tokens per method, with the device's capacity drawn in."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(8, 4.5))
    for name, points in series.items():
        xs, ys = zip(*points, strict=True)
        axes.plot(xs, ys, label=name)
    axes.axhline(capacity, color="black", linestyle="--", label=f"{device} ({capacity:.1f} GB)")
    axes.set(xlabel="generated tokens", ylabel="weights + KV + overhead (GB)", title=title)
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    return _save(figure, path)


def heatmap(path: str | Path, values: list[list[float]], columns: list[str], rows: list[str],
            xlabel: str, ylabel: str, title: str) -> Path:
    """A 0..1 grid (e.g. accuracy): values[row][column], each cell labelled."""
    figure, axes = plt.subplots(figsize=(1.2 * len(columns) + 2.5, 0.8 * len(rows) + 1.8))
    image = axes.imshow(values, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    axes.set_xticks(range(len(columns)), columns)
    axes.set_yticks(range(len(rows)), rows)
    for r, line in enumerate(values):
        for c, value in enumerate(line):
            axes.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=9)
    axes.set(xlabel=xlabel, ylabel=ylabel, title=title)
    figure.colorbar(image, ax=axes)
    return _save(figure, path)


def _save(figure, path: str | Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)
