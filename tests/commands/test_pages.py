"""Generated blocks of Markdown pages (``kvmix report``, the docs hook): the references come
from the code, benchmark tables and figures from committed results.json files, and the README
in this checkout is what its results make."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvmix.cli import main
from kvmix.commands import pages
from kvmix.commands.report import ReportConfig, run_report
from kvmix.methods import method_names

ROOT = Path(__file__).resolve().parents[2]


def _result(folder: Path, ppl: float, created: str = "2026-12-05T10:00:00+00:00") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps({
        "command": "compare", "invocation": "kvmix compare --methods full,kivi2",
        "versions": {"kvmix": "0.1.0", "torch": "2.13.0"},
        "machine": {"cpu": "Test CPU", "cores": 2, "isa": ["avx2"], "gpu": None,
                    "commit": "abc123"},
        "created": created, "table": {"title": "kvmix compare · tiny",
                                      "columns": {"method": "method", "ppl": "ppl"}},
        "rows": [{"method": "full", "ppl": ppl}, {"method": "kivi2", "ppl": ppl + 1}]}))


def _page(tmp_path: Path, body: str) -> Path:
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(f"# page\n\n{body}\n<!-- kvmix:end -->\n")
    return page


def test_results_table_shows_the_newest_run_with_its_provenance(tmp_path):
    runs = tmp_path / pages.RUNS
    _result(runs / "2026-12-01-old" / "compare", 9.0)
    _result(runs / "2026-12-05-new" / "compare", 10.0)
    page = _page(tmp_path, "<!-- kvmix:results compare -->\nanything")
    text = pages.render(page.read_text(), page, tmp_path)
    assert "| method | ppl |" in text and "| full | 10 |" in text and "| kivi2 | 11 |" in text
    assert "9" not in text.split("kvmix:results")[1].split("Measured")[0]
    assert "Measured 2026-12-05 on Test CPU, 2 cores (avx2)" in text
    assert "commit `abc123`" in text and "`kvmix compare --methods full,kivi2`" in text
    assert "anything" not in text
    assert pages.stale([page], tmp_path) == [page]
    page.write_text(text)
    assert pages.stale([page], tmp_path) == []


def test_repeats_show_median_and_range(tmp_path):
    for repeat, ppl in enumerate((10.0, 12.0, 11.0)):
        _result(tmp_path / pages.RUNS / "2026-12-05-m" / "compare" / str(repeat), ppl)
    page = _page(tmp_path, "<!-- kvmix:results compare -->")
    text = pages.render(page.read_text(), page, tmp_path)
    assert "| full | 11 (10–12) |" in text and "median (min–max) of 3 runs" in text


def test_figure_links_relative_to_the_page(tmp_path):
    folder = tmp_path / pages.RUNS / "2026-12-05-m" / "compare"
    _result(folder, 10.0)
    (folder / "compare.png").write_bytes(b"png")
    page = _page(tmp_path, "<!-- kvmix:figure compare/compare.png -->")
    text = pages.render(page.read_text(), page, tmp_path)
    assert "(benchmarks/runs/2026-12-05-m/compare/compare.png)" in text
    page = _page(tmp_path, "<!-- kvmix:figure compare/missing.png -->")
    with pytest.raises(ValueError, match=r"missing\.png"):
        pages.render(page.read_text(), page, tmp_path)


def test_unknown_blocks_and_missing_results_are_errors(tmp_path):
    page = _page(tmp_path, "<!-- kvmix:nonsense -->")
    with pytest.raises(ValueError, match=r"unknown block kvmix:nonsense; valid: cli"):
        pages.render(page.read_text(), page, tmp_path)
    page = _page(tmp_path, "<!-- kvmix:results loadtest -->")
    with pytest.raises(ValueError, match="no results named 'loadtest'"):
        pages.render(page.read_text(), page, tmp_path)


def test_references_come_from_the_code(tmp_path):
    page = _page(tmp_path, "<!-- kvmix:cli -->")
    cli = pages.render(page.read_text(), page, tmp_path)
    for command in ("compare", "serve", "loadtest", "report"):
        assert f"## kvmix {command}\n" in cli
    assert "`--methods`" in cli and "&lt;" in cli  # plan --hardware's mac-<N>gb, escaped
    assert "| `--temperature` | `0.0` |" in cli  # a zero default is shown
    page = _page(tmp_path, "<!-- kvmix:metrics -->")
    metrics = pages.render(page.read_text(), page, tmp_path)
    assert "`kvmix:num_requests_running`" in metrics
    assert "`kvmix:request_success_total`" in metrics
    page = _page(tmp_path, "<!-- kvmix:methods -->")
    methods = pages.render(page.read_text(), page, tmp_path)
    assert all(f"| {name} |" in methods for name in method_names())


def test_report_check_fails_on_a_stale_page_and_rewrites_it(tmp_path):
    _result(tmp_path / pages.RUNS / "2026-12-05-m" / "compare", 10.0)
    page = _page(tmp_path, "<!-- kvmix:results compare -->")
    with pytest.raises(SystemExit) as stopped:
        run_report(ReportConfig(paths=[str(page)], root=str(tmp_path), check=True))
    assert stopped.value.code == 1
    assert run_report(ReportConfig(paths=[str(page)], root=str(tmp_path))) == [page]
    assert main(["report", str(page), "--root", str(tmp_path), "--check"]) == 0


def test_pages_with_results_match_the_committed_results():
    """The README's and the docs' tables and figures are what docs/benchmarks/runs/ holds:
    after a new run, `kvmix report README.md docs/...` rewrites them. (The references are
    filled at each docs build.)"""
    shown = [path for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
             if re.search(r"<!-- kvmix:(results|figure) ", path.read_text())]
    assert ROOT / "README.md" in shown and ROOT / "docs/benchmarks/index.md" in shown
    assert pages.stale(shown, ROOT) == []
