"""``kvmix compare`` on the tiny Llama with the default model's tokenizer: the table shows
cache sizes in MB, results.json keeps the bytes, and ``--out`` gets the bytes-against-KL plot."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import served_llama
from helpers import method_string

from kvmix.commands.compare import CompareConfig, run_compare
from kvmix.models.loading import LoadedModel, load_tokenizer


@pytest.fixture(scope="module")
def loaded():
    tokenizer = load_tokenizer("smollm2")
    return LoadedModel(served_llama(tokenizer), tokenizer, "tiny-llama", "test", torch.float32)


def test_compare_prints_megabytes_and_plots_bytes_against_kl(loaded, tmp_path, capsys):
    kivi = method_string("kivi2")
    rows = run_compare(CompareConfig(methods=["full", kivi], context=64, eval_tokens=16,
                                     out=str(tmp_path)), loaded)
    out = capsys.readouterr().out
    assert "cache MB" in out and "MB@16" in out and "cache bytes" not in out
    full, quantized = rows
    assert quantized["nbytes"] < full["nbytes"]
    for row in rows:
        assert f"{row['nbytes'] / 1e6:.4g}" in out and str(row["nbytes"]) not in out
    saved = json.loads((tmp_path / "results.json").read_text())
    for row, kept in zip(rows, saved["rows"], strict=True):
        assert isinstance(kept["nbytes"], int) and kept["nbytes"] == row["nbytes"]
        assert kept["cache_mb"] == pytest.approx(row["nbytes"] / 1e6)
    plot = tmp_path / "compare.png"
    assert saved["plots"] == [str(plot)] and plot.read_bytes()[:4] == b"\x89PNG"
    assert plot.stat().st_size > 10_000  # axes, two labelled points and a title drawn


def test_compare_without_out_draws_no_plot(loaded, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_compare(CompareConfig(methods=["full"], context=64, eval_tokens=16), loaded)
    assert list(tmp_path.iterdir()) == []
