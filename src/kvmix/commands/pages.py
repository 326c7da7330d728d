"""Generated blocks in Markdown pages (the README, the docs site): the CLI reference from the
argparse parsers, the ``/metrics`` list from the server's registry, the methods table from the
method registry, and benchmark tables and figures from committed ``results.json`` files.

A block is the text between ``<!-- kvmix:KIND ARGUMENT -->`` and ``<!-- kvmix:end -->``;
``render`` replaces what lies between with what KIND makes now, so a page can be checked for
staleness by rendering it again. Results live under ``docs/benchmarks/runs/RUN/NAME/``, one
folder per run (named ``DATE-MACHINE``); ``results NAME`` shows the newest run's ``NAME``
results (several ``results.json`` below ``NAME`` are repeats, shown as median (min-max)),
``figure NAME/FILE.png`` its plot.
"""

from __future__ import annotations

import argparse
import html
import importlib
import json
import os
import re
import statistics
from collections.abc import Callable
from pathlib import Path

from kvmix.jobs.report import cell

RUNS = Path("docs/benchmarks/runs")  # below the repository's root
SERIES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}  # as scraped
BLOCK = re.compile(r"(<!-- kvmix:(\w+)(?: ([^>]*?))? -->\n).*?(<!-- kvmix:end -->)", re.S)


def render(text: str, page: Path, root: Path) -> str:
    """``text`` (the page at ``page``) with every generated block made anew; ``root``: the
    repository, where ``RUNS`` lies. Links are relative to the page."""

    def fill(match: re.Match) -> str:
        opening, kind, argument, end = match.groups()
        if kind not in KINDS:
            raise ValueError(f"{page}: unknown block kvmix:{kind}; valid: {', '.join(KINDS)}")
        body = KINDS[kind](argument or "", page, root).strip("\n")
        return f"{opening}{body}\n{end}"

    return BLOCK.sub(fill, text)


def stale(paths: list[Path], root: Path) -> list[Path]:
    """The pages whose generated blocks differ from what ``render`` makes now."""
    return [path for path in paths
            if render(path.read_text(), path.resolve(), root) != path.read_text()]


# --- the generated references -------------------------------------------------------------

def cli_reference(_argument: str, _page: Path, _root: Path) -> str:
    """Every ``kvmix`` subcommand: its usage and a table of its options."""
    from kvmix.commands import parser as make_parser
    from kvmix.commands import subcommands

    parser = make_parser()
    parts = [_usage(parser)]
    for name, sub in subcommands(parser).items():
        parts += [f"## kvmix {name}", sub.description or "", _usage(sub), _options(sub)]
    return "\n\n".join(part for part in parts if part)


def _usage(parser: argparse.ArgumentParser) -> str:
    """The usage line at a fixed width (argparse's own follows the terminal)."""
    formatter = argparse.HelpFormatter(parser.prog, width=88)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return f"```text\n{formatter.format_help().strip()}\n```"


def _options(parser: argparse.ArgumentParser) -> str:
    lines = ["| option | default | what it sets |", "|---|---|---|"]
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        flags = ", ".join(f"`{flag}`" for flag in action.option_strings) or f"`{action.dest}`"
        default = action.default
        hidden = default is None or default is False or default is argparse.SUPPRESS
        shown = "" if hidden else f"`{default}`"
        lines.append(f"| {flags} | {shown} | {_escape(action.help or '')} |")
    return "\n".join(lines)


def metrics_reference(_argument: str, _page: Path, _root: Path) -> str:
    """Every series ``kvmix serve`` exposes at ``/metrics``, from its registry."""
    from kvmix.serving.metrics import GAUGES, Metrics

    metrics = Metrics(lambda: dict.fromkeys(GAUGES, 0.0), model="MODEL")
    lines = ["Every series carries the label `model_name`.", "",
             "| metric | type | meaning |", "|---|---|---|"]
    for family in metrics.registry.collect():
        names = ", ".join(f"`{family.name}{end}`" for end in SERIES.get(family.type, ("",)))
        lines.append(f"| {names} | {family.type} | {_escape(family.documentation)} |")
    return "\n".join(lines)


def methods_table(_argument: str, _page: Path, _root: Path) -> str:
    """Every method and preset (``kvmix methods``' rows)."""
    from kvmix.commands.methods import COLUMNS, method_rows

    return _table(method_rows(), COLUMNS)


# --- benchmark results ----------------------------------------------------------------------

def results_table(name: str, page: Path, root: Path) -> str:
    """The newest run's ``name`` results: where and how they were made, then the table."""
    runs = _results(name, root)
    first = runs[0]
    rows, note = (first["rows"], "") if len(runs) == 1 else (_aggregate(runs), (
        f" Numbers: median (min–max) of {len(runs)} runs."))
    table = printed(first)
    return (f"*{table['title']}*\n\n{_provenance(first)}{note}\n\n"
            f"{_table(rows, table['columns'])}")


def figure(argument: str, page: Path, root: Path) -> str:
    """A plot of the newest run that has it, linked relative to the page."""
    name, _, file = argument.partition("/")
    folder = _newest(name, root)
    path = folder / file
    if not path.is_file():
        raise ValueError(f"{page}: figure {argument!r}: {path} is missing")
    first = _load(sorted(folder.rglob("results.json"))[0])
    link = os.path.relpath(path, page.parent)
    return f"![{first['command']}: {file}]({link})\n\n{_provenance(first)}"


def printed(result: dict) -> dict:
    """The table a results.json was printed with: its own record, or (files written before it
    kept one) its command's ``COLUMNS``."""
    if "table" in result:
        return result["table"]
    command = importlib.import_module(f"kvmix.commands.{result['command']}")
    return {"title": f"kvmix {result['command']}", "columns": command.COLUMNS}


def _newest(name: str, root: Path) -> Path:
    folders = sorted(run / name for run in (root / RUNS).glob("*/")
                     if any((run / name).rglob("results.json")))
    if not folders:
        raise ValueError(f"no results named {name!r} under {root / RUNS}")
    return folders[-1]


def _results(name: str, root: Path) -> list[dict]:
    return [_load(path) for path in sorted(_newest(name, root).rglob("results.json"))]


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _provenance(result: dict) -> str:
    """Date, machine, versions and the command line of one results.json."""
    machine, versions = result.get("machine") or {}, result.get("versions") or {}
    where = machine.get("cpu", "an unrecorded machine")
    if machine.get("cores"):
        where += f", {machine['cores']} cores"
    if machine.get("isa"):
        where += f" ({' '.join(machine['isa'])})"
    if machine.get("gpu"):
        where += f", {machine['gpu']}"
    software = ", ".join(f"{name} {versions[name]}" for name in ("kvmix", "torch", "transformers")
                         if versions.get(name))
    commit = f" at commit `{machine['commit']}`" if machine.get("commit") else ""
    command = f" Command: `{result['invocation']}`." if result.get("invocation") else ""
    return (f"Measured {result.get('created', '?')[:10]} on {where}; {software}{commit}."
            f"{command}")


def _aggregate(runs: list[dict]) -> list[dict]:
    """Rows of repeated runs, matched by position: numbers as median (min–max)."""
    merged = []
    for rows in zip(*(run["rows"] for run in runs), strict=True):
        row = {}
        for key, value in rows[0].items():
            values = [other.get(key) for other in rows]
            numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
            row[key] = (f"{cell(statistics.median(values))} ({cell(min(values))}–"
                        f"{cell(max(values))})" if numeric and len(set(values)) > 1 else value)
        merged.append(row)
    return merged


def _table(rows: list[dict], columns: dict[str, str]) -> str:
    lines = [f"| {' | '.join(columns.values())} |", f"|{'---|' * len(columns)}"]
    lines += [f"| {' | '.join(_escape(cell(row.get(key))) for key in columns)} |"
              for row in rows]
    return "\n".join(lines)


def _escape(text: str) -> str:
    """A table cell: no pipes or line breaks, and ``<N>`` shown, not read as HTML."""
    return html.escape(str(text), quote=False).replace("|", "\\|").replace("\n", " ")


KINDS: dict[str, Callable[[str, Path, Path], str]] = {
    "cli": cli_reference, "metrics": metrics_reference, "methods": methods_table,
    "results": results_table, "figure": figure,
}
