"""Models split across devices (``device_map``): each cache layer lives on its own layer's
device, weights offloaded by transformers' (accelerate's) hooks are read where kvmix needs them,
and generation equals the unsplit model's, token for token."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from transformers import AutoModelForCausalLM

import kvmix


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_llama(seed=4).save_pretrained(path)
    return path


@pytest.mark.parametrize("method", ["kivi2", "pnmix1", "kxvy:budget=3"])
def test_a_model_split_and_offloaded_generates_what_the_whole_model_does(saved, tmp_path,
                                                                          method):
    whole = AutoModelForCausalLM.from_pretrained(saved).eval()
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    split = AutoModelForCausalLM.from_pretrained(saved, device_map=device_map,
                                                 offload_folder=str(tmp_path)).eval()
    assert split.model.layers[1].self_attn.k_proj.weight.device.type == "meta"  # offloaded
    prompt = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(4))
    out, norms = {}, {}
    for name, model in (("whole", whole), ("split", split)):
        cache = kvmix.make_cache(model, method, backend="torch")
        with torch.no_grad():
            out[name] = model.generate(prompt, cache=cache, max_new_tokens=20, do_sample=False,
                                       eos_token_id=None)
        assert all(layer.device.type == "cpu" for layer in cache.layers)
        norms[name] = cache.spec.kv_norms  # read through the offload hooks for the split model
    assert torch.equal(norms["whole"], norms["split"])
    assert torch.equal(out["whole"], out["split"])
