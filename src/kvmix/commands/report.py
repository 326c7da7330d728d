"""``kvmix report``: results again, from their ``results.json``, and the generated blocks of
Markdown pages (benchmark tables and figures, the CLI, ``/metrics`` and methods references)
made anew from them: ``kvmix report README.md`` rewrites the page, ``--check`` only says
which pages are stale."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvmix.commands import pages
from kvmix.commands.args import config_from
from kvmix.jobs.report import console, print_table


@dataclass
class ReportConfig:
    paths: list[str] = field(default_factory=lambda: ["README.md"])
    root: str = "."
    check: bool = False


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "report", help="show results.json files again; regenerate or check Markdown pages")
    parser.add_argument("paths", nargs="*", default=["README.md"],
                        help="Markdown pages to regenerate (default README.md), or results "
                             "folders / results.json files to print")
    parser.add_argument("--root", default=".",
                        help=f"the repository: {pages.RUNS} lies below it")
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 when a page differs from its results")
    parser.set_defaults(run=lambda args: run_report(config_from(ReportConfig, args)))


def run_report(config: ReportConfig) -> list[Path]:
    """Print the results given; render (or with ``check``, compare) the pages given. Returns
    the pages that were stale."""
    root = Path(config.root)
    paths = [Path(path) for path in config.paths]
    for path in paths:
        if not path.exists():
            raise ValueError(f"paths: {path} does not exist")
    for path in paths:
        if path.suffix != ".md":
            _print_results(path)
    documents = [path for path in paths if path.suffix == ".md"]
    stale = pages.stale(documents, root)
    for page in stale:
        if config.check:
            console.print(f"{page} is stale: run kvmix report {page}")
        else:
            page.write_text(pages.render(page.read_text(), page.resolve(), root))
            console.print(f"rewrote {page}")
    if config.check and stale:
        sys.exit(1)
    return stale


def _print_results(path: Path) -> None:
    files = [path] if path.is_file() else sorted(path.rglob("results.json"))
    if not files:
        raise ValueError(f"paths: {path} holds no results.json")
    for file in files:
        result = json.loads(file.read_text())
        table = pages.printed(result)
        print_table(f"{table['title']} ({file})", result["rows"], table["columns"])
