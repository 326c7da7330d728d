"""``kvmix methods``: every method and preset, its parameters and its bit formula."""

from __future__ import annotations

from kvmix.jobs.report import print_table
from kvmix.methods import method_classes, parameters, presets
from kvmix.runtime.kernels import cpu


def add_parser(commands) -> None:
    parser = commands.add_parser("methods", help="list methods, presets, parameters, bit formulas")
    parser.set_defaults(run=lambda args: run_methods())


COLUMNS = {"method": "method", "about": "about", "bits": "bits per element",
           "fast_path": "fast path", "parameters": "parameters"}


def run_methods() -> list[dict]:
    rows = method_rows()
    print_table("kvmix methods", rows, COLUMNS)
    print(f"CPU decode op: {cpu.describe()}")
    return rows


def method_rows() -> list[dict]:
    """Every registered method and preset: what it is, its bit formula and parameters."""
    rows = [{"method": name, "about": cls.summary, "bits": cls.describe(),
             "fast_path": cls.fast_path,
             "parameters": ", ".join(f"{k}={_show(v)}" for k, v in parameters(cls).items())}
            for name, cls in method_classes().items()]
    rows += [{"method": name, "about": f"preset of {cls.name}",
              "parameters": ", ".join(f"{k}={v}" for k, v in params.items())}
             for name, (cls, params) in presets().items()]
    return rows


def _show(value) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)
