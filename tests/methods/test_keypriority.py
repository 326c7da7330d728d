"""Key-priority: weight norms, the budget allocator, Hadamard rotation, quanto/HQQ backends."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, tiny_llama
from helpers import attend
from transformers import LlamaConfig

import kvmix
from kvmix.core.allocation import allocate
from kvmix.core.transforms import hadamard
from kvmix.methods import parse_method
from kvmix.methods.backends import dequantize_rows, quantize_rows
from kvmix.models.weights import kv_weights, weight_norms
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.folding import prepare_model

H, HQ, D = TINY["num_key_value_heads"], TINY["num_attention_heads"], TINY["head_dim"]


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_norms_match_torch_linalg_on_known_weights():
    model = tiny_llama()
    attention = model.model.layers[1].self_attn
    known_k = torch.diag(torch.arange(1.0, H * D + 1))[:, : TINY["hidden_size"]]  # spectral = 64
    with torch.no_grad():
        attention.k_proj.weight.copy_(known_k)
        attention.v_proj.weight.copy_(torch.ones_like(attention.v_proj.weight))
    norms = weight_norms(kv_weights(model))
    assert norms["keys_spectral"][1].item() == pytest.approx(64.0)
    assert norms["values_spectral"][1].item() == pytest.approx((H * D * TINY["hidden_size"]) ** 0.5)
    for side, proj in (("keys", "k_proj"), ("values", "v_proj")):
        for layer in range(2):
            weight = getattr(model.model.layers[layer].self_attn, proj).weight.double()
            assert norms[f"{side}_frobenius"][layer].item() == pytest.approx(
                torch.linalg.matrix_norm(weight).item())
            assert norms[f"{side}_spectral"][layer].item() == pytest.approx(
                torch.linalg.matrix_norm(weight, ord=2).item())
            per_head = torch.linalg.matrix_norm(weight.view(H, D, -1), ord=2)
            torch.testing.assert_close(norms[f"{side}_spectral_heads"][layer], per_head)


def test_fused_qkv_projections_are_split():
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    model = Phi3ForCausalLM(Phi3Config(vocab_size=50, hidden_size=64, intermediate_size=64,
                                       num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                       bos_token_id=1))
    weights = kv_weights(model)
    qkv = model.model.layers[0].self_attn.qkv_proj.weight  # [q (64); k (32); v (32)] rows
    torch.testing.assert_close(weights[0].keys.flatten(0, 1), qkv[64:96])
    torch.testing.assert_close(weights[0].values.flatten(0, 1), qkv[96:])


def test_unsupported_projections_are_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="no attention modules with k_proj/v_proj or a fused"):
        kv_weights(model)


@pytest.mark.parametrize("budget, allowed", [(3, (1, 2, 3, 4, 8)), (2.5, (1, 2, 3, 4)),
                                             (3, (2, 4)), (2, (1, 2, 3))])
def test_allocator_meets_the_budget_exactly(budget, allowed):
    weights = gaussian(7, 2).abs() * 10 + 0.1
    bits = allocate(weights, budget, allowed)
    assert bits.float().mean().item() == pytest.approx(budget)
    assert set(bits.flatten().tolist()) <= set(allowed)


def test_allocator_gives_the_larger_norm_side_more_bits():
    weights = torch.tensor([[100.0, 1.0], [100.0, 1.0], [1.0, 100.0]])  # keys win in layers 0, 1
    bits = allocate(weights, 3, (1, 2, 3, 4, 8))
    assert (bits[:2, 0] > bits[:2, 1]).all() and bits[2, 1] > bits[2, 0]
    uniform = torch.full_like(bits, 3)
    proxy = lambda b: (weights * 4.0 ** -b.double()).sum()  # noqa: E731
    assert proxy(bits) < proxy(uniform)


def test_budget_mode_plans_per_layer_bits_from_the_model(tiny_model):
    cache = kvmix.make_cache(tiny_model, "kxvy:budget=3,allowed=2/4,sink=4,residual=16,group=8")
    plan = cache.method.plan
    assert sum(plan["key_bits"]) + sum(plan["value_bits"]) == 3 * 2 * 2
    with torch.no_grad():
        tiny_model(torch.randint(1, 97, (1, 40)), cache=cache, use_cache=True)
    assert [layer.rows[0].blocks.keys.bits for layer in cache.layers] == plan["key_bits"]
    with pytest.raises(ValueError, match="budget mode needs the model's W_K/W_V norms"):
        KVMixCache("kxvy:budget=3", LlamaConfig(**TINY))
    with pytest.raises(ValueError, match=r"budget=9\.0 is outside the allowed widths"):
        kvmix.make_cache(tiny_model, "kxvy:budget=9.0")


def test_hadamard_is_orthogonal_and_leaves_scores_unchanged():
    h = hadamard(64, torch.float64)
    torch.testing.assert_close(h @ h.T, torch.eye(64, dtype=torch.float64))
    q, k = gaussian(5, 64).double(), gaussian(7, 64, seed=1).double()
    torch.testing.assert_close((q @ h) @ (k @ h).T, q @ k.T)
    assert not torch.allclose(k @ h, k)
    with pytest.raises(ValueError, match="power-of-two size; got 48"):
        hadamard(48)


def test_key_rotation_stores_rotated_keys_and_keeps_logits(tiny_model):
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(3))
    layout = "key_bits=8,value_bits=8,sink=4,residual=16,group=8,residual_dtype=float32"
    logits, layers = {}, {}
    for rotate in ("none", "keys", "values", "both"):
        method = f"kxvy:{layout},rotate={rotate}"
        runner = prepare_model(tiny_model, method)
        cache = kvmix.make_cache(runner, method)
        with torch.no_grad():
            runner(ids, cache=cache, use_cache=True)
            logits[rotate] = runner(ids[:, :5], cache=cache, use_cache=True).logits
        layers[rotate] = cache.layers[0].rows[0]
    for rotate in ("keys", "values", "both"):
        torch.testing.assert_close(logits[rotate], logits["none"], rtol=0, atol=5e-3)
    h = hadamard(D)
    torch.testing.assert_close(layers["keys"].res_keys, layers["none"].res_keys @ h,
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(layers["values"].res_values, layers["none"].res_values @ h,
                               rtol=0, atol=1e-5)  # values arrive rotated from the folded W_V


def test_value_rotation_folds_into_a_copy_and_refuses_an_unfolded_model(tiny_model):
    method = "kxvy:rotate=values,sink=4,residual=16,group=8"
    folded = prepare_model(tiny_model, method)
    ids = torch.randint(1, 97, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(folded(ids).logits, tiny_model(ids).logits, rtol=0, atol=1e-4)
    assert not torch.equal(folded.model.layers[0].self_attn.v_proj.weight,
                           tiny_model.model.layers[0].self_attn.v_proj.weight)
    with pytest.raises(ValueError, match="rotate='values' needs the model with the value"):
        kvmix.make_cache(tiny_model, method)


@pytest.mark.parametrize("backend, bits", [("quanto", 2), ("quanto", 4), ("hqq", 1), ("hqq", 2),
                                           ("hqq", 4), ("hqq", 8)])
def test_library_backends_round_trip_within_their_step(backend, bits):
    """Rounding to the nearest level: half a step, plus what float16 scale and zero add (a zero
    of up to 2^bits levels kept to 11 significant bits: 2^bits/2048 of a step)."""
    rows = gaussian(2, 24, 32) * 3
    q = quantize_rows(rows, bits, backend)
    step = (rows.amax(-1, keepdim=True) - rows.amin(-1, keepdim=True)) / (2**bits - 1)
    error = (dequantize_rows(q, torch.float32) - rows).abs()
    assert (error <= step * (0.5 + 2**bits / 2048) + 1e-3).all() and error.mean() > 0
    packed = q.data.numel() * q.data.element_size()
    assert q.data.dtype == torch.uint8 and packed * 8 == rows.numel() * bits
    assert q.scale.dtype == q.zero.dtype == torch.float16 and q.scale.shape == (2, 24, 1)


@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_library_backends_in_the_cache_count_their_bytes(tiny_model, backend):
    cache = kvmix.make_cache(tiny_model, f"kxvy:backend={backend},key_bits=4,value_bits=2,"
                                          "sink=4,residual=16,group=8")
    with torch.no_grad():
        tiny_model(torch.randint(1, 97, (2, 45)), cache=cache, use_cache=True)
    kinds = cache.nbytes_breakdown()
    blocks = len(cache.layers[0].rows[0].lengths) * 2 * 2 * H * 8 * D  # blocks·layers·B·H·G·D
    assert kinds["codes"] * 8 == blocks * (4 + 2)
    assert cache.nbytes() == cache.theoretical_nbytes()
    native = kvmix.make_cache(tiny_model, "kxvy:key_bits=4,value_bits=2,sink=4,residual=16,group=8")
    with torch.no_grad():
        tiny_model(torch.randint(1, 97, (2, 45)), cache=native, use_cache=True)
    assert native.nbytes() == cache.nbytes()


@pytest.mark.parametrize("spec, message", [
    ("kxvy:backend=hqq,key_bits=3", r"backend='hqq' cannot store key/value widths of \[3\]"),
    ("kxvy:backend=quanto,key_bits=1", r"backend='quanto' cannot store .* \[1\] bits"),
    ("kxvy:backend=torchao", r"backend='torchao' is invalid; valid: native, quanto, hqq"),
    ("kxvy:rotate=queries", r"rotate='queries' is invalid"),
    ("kxvy:budget=3,allowed=2/3,backend=quanto", r"cannot store budget widths of \[3\]"),
])
def test_backend_and_rotation_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_method(spec)


def test_padding_stays_out_of_library_statistics():
    keys = gaussian(1, H, 11, D)
    keys[:, :, :3] = 1000.0  # padded positions
    valid = torch.tensor([[False] * 3 + [True] * 8])
    cache = KVMixCache("kxvy:backend=quanto,key_bits=4,value_bits=4,sink=0,residual=8,group=8",
                       LlamaConfig(**TINY))
    cache.update(keys, keys.clone(), 0)
    attend(cache, gaussian(1, HQ, 11, D), valid[:, None, None, :])
    decoded = cache.layers[0].rows[0].decode_blocks(torch.float32)[0]  # the 8 real tokens
    real = keys[:, :, 3:]
    step = (real.amax(-2) - real.amin(-2)) / 15
    assert ((decoded - real).abs() <= step.unsqueeze(-2) * 0.51 + 1e-3).all()
