"""The architectures users bring, as tiny random-weight models from transformers' own config
classes: kvmix's ``full`` cache reproduces ``DynamicCache``'s logits, or ``make_cache`` refuses
the model naming the feature kvmix's attention does not compute; quantizing methods generate a
padded batch exactly as each sequence alone, or are refused at ``make_cache`` with the reason."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from helpers import method_string, padded_prompts
from transformers import DynamicCache

import kvmix

BASE = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 256, "pad_token_id": 0}
ARCHITECTURES = {
    "llama": ("LlamaConfig", {}),
    "mistral-sliding": ("MistralConfig", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3-qk-norm": ("Qwen3Config", {}),
    "gemma3": ("Gemma3TextConfig", {"sliding_window": 8, "head_dim": 64,
                                     "layer_types": ["sliding_attention", "full_attention"]}),
    "phi3-fused-partial": ("Phi3Config", {"partial_rotary_factor": 0.5, "head_dim": None,
                                           "hidden_size": 128, "num_attention_heads": 2,
                                           "num_key_value_heads": 2}),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {"attention_multiplier": 0.2}),
    "mqa": ("LlamaConfig", {"num_key_value_heads": 1}),
    "head-dim-64": ("LlamaConfig", {"head_dim": 64}),
    "head-dim-80": ("LlamaConfig", {"head_dim": 80}),
    "head-dim-128": ("LlamaConfig", {"head_dim": 128}),
    "head-dim-256": ("LlamaConfig", {"head_dim": 256, "num_attention_heads": 2,
                                     "num_key_value_heads": 1}),
}
REFUSED = {  # architecture: (config, overrides, the feature the refusal names)
    "gemma2-softcap": ("Gemma2Config", {"sliding_window": 8}, "attn_logit_softcapping=50.0"),
    "gpt-oss-sinks": ("GptOssConfig", {"num_local_experts": 2, "num_experts_per_tok": 1,
                                       "sliding_window": 8}, "attention sinks"),
}
METHODS = ["kivi2", "pnmix1", "ggml-k8v4", "polar"]


def build(name: str, config: str, overrides: dict, seed: int = 0):
    settings = {**BASE, **overrides}
    if settings["head_dim"] is None:  # derived from hidden_size / heads
        settings.pop("head_dim")
    cls = getattr(transformers, config)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cls(**settings))
    return model.float().eval()


def logits(model, ids: torch.Tensor, cache) -> torch.Tensor:
    """A prompt, then three single-token steps: the logits of every position, [B, T, V]."""
    out = [model(ids[:, :-3], cache=cache, use_cache=True).logits]
    for t in range(3, 0, -1):
        step = ids[:, -t:][:, :1]
        out.append(model(step, cache=cache, use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_full_reproduces_dynamic_cache(name):
    model = build(name, *ARCHITECTURES[name])
    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = logits(model, ids, DynamicCache(config=model.config))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # sliding layers keep a float cache: said once
            got = logits(model, ids, kvmix.make_cache(model, "full", backend="torch"))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_bfloat16_full_matches_dynamic_cache_exactly_and_the_fused_op_within_two_ulps(name):
    """bfloat16: the reference path reads the same values as DynamicCache (equal logits; with a
    sliding window within two ulps, as the CPU's SDPA kernels round); the fused CPU op computes
    in float32 and rounds once, within two bfloat16 ulps (2^-7 relative) of the logits' scale."""
    model = build(name, *ARCHITECTURES[name]).to(torch.bfloat16)
    ids = torch.randint(1, 97, (2, 14), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = logits(model, ids, DynamicCache(config=model.config)).float()
        reference = logits(model, ids, kvmix.make_cache(model, "full", backend="torch"))
        fused = logits(model, ids, kvmix.make_cache(model, "full", backend="cpu")).float()
    if getattr(model.config, "sliding_window", None) is None:
        assert torch.equal(reference.float(), expected)
    else:  # a window's mask: CPU SDPA may round bfloat16 in another kernel (0.0055 on an EPYC)
        assert (reference.float() - expected).abs().max() <= 2**-7 * expected.abs().max()
    assert (fused - expected).abs().max() <= 2**-7 * expected.abs().max()


@pytest.mark.parametrize("name", list(REFUSED))
def test_attention_kvmix_does_not_compute_is_refused_at_make_cache(name):
    config, overrides, feature = REFUSED[name]
    model = build(name, config, overrides)
    with pytest.raises(ValueError, match=feature):
        kvmix.make_cache(model, "kivi2")


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("name", list(ARCHITECTURES))
def test_every_method_generates_a_padded_batch_as_each_sequence_alone_or_is_refused(name,
                                                                                      method):
    model = build(name, *ARCHITECTURES[name])
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (9, 21)]
    greedy = {"max_new_tokens": 10, "min_new_tokens": 10, "do_sample": False}
    method = method_string(method)  # sink 4, residual 16, groups of 8: pages seal
    runner = kvmix.prepare_model(model, method)
    try:
        cache = kvmix.make_cache(runner, method, backend="torch")
    except ValueError as refusal:  # refused up front, naming what the model lacks
        assert "head dim" in str(refusal) or "RoPE channel pairs" in str(refusal), refusal
        return
    ids, mask = padded_prompts(prompts)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        together = runner.generate(ids, attention_mask=mask, cache=cache, **greedy)
        for b, prompt in enumerate(prompts):
            alone = runner.generate(prompt[None], cache=kvmix.make_cache(runner, method,
                                                                         backend="torch"),
                                    **greedy)
            assert torch.equal(together[b, ids.shape[1]:], alone[0, len(prompt):]), f"row {b}"
