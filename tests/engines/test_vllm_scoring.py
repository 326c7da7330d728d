"""``kvmix compare --engine vllm``'s scoring through vLLM, on the tiny Llama: vLLM's float
cache scores the tokens as kvmix's own path does (the same tokens, the same positions), and a
packed method through vLLM reads its packed cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import tiny_llama

from kvmix.engines.vllm import scoring as vllm_scoring
from kvmix.engines.vllm.server import DEFAULT_PYTHON
from kvmix.evaluation.scoring import score
from kvmix.models.loading import LoadedModel

PYTHON = Path(__file__).resolve().parents[2] / DEFAULT_PYTHON
CONTEXT, TOKENS = 96, 48


@pytest.mark.process
@pytest.mark.skipif(not PYTHON.is_file(), reason="the vLLM environment is not built (make vllm)")
def test_vllm_scores_the_tokens_kvmix_scores(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMIX_CACHE", str(tmp_path))
    model = tiny_llama()
    loaded = LoadedModel(model, None, "tiny", "tiny", torch.float32)
    ids = torch.randint(1, 97, (1, CONTEXT + TOKENS + 1),
                        generator=torch.Generator().manual_seed(3))
    kivi = vllm_scoring.vllm_layout("kivi2")
    assert kivi == "kivi2:sink=0,residual=32"
    engine = vllm_scoring.score(str(PYTHON), loaded, ids, CONTEXT, ["full", kivi])
    own = score(model, ids, "full", CONTEXT)
    assert len(engine["full"]["nll"]) == TOKENS
    assert engine["full"]["ppl"] == pytest.approx(own.ppl, rel=1e-4)
    assert engine[kivi]["ppl"] != engine["full"]["ppl"]
    assert engine[kivi]["block_size"] == 32
