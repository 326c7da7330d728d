"""WUSH-KV: clipped quantizers, calibrated transforms, folding, export, bad input."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import tiny_llama
from helpers import attend
from safetensors import safe_open

import kvmix
from kvmix.core.quantizers import (
    QUEST_CLIP,
    dequantize,
    percentile_bounds,
    percentile_quantize,
    quest_dequantize,
    quest_quantize,
)
from kvmix.core.transforms import (
    KINDS,
    TransformSet,
    block_transform,
    hadamard,
    load_transforms,
    save_multipliers,
    save_transforms,
)
from kvmix.evaluation.calibration import collect_moments, compute_transforms
from kvmix.methods import parse_method
from kvmix.runtime.folding import prepare_model

LAYOUT = "sink=4,residual=16,group=8"


def gaussian(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


@pytest.fixture(scope="module")
def transforms_file(model, tmp_path_factory):
    ids = torch.randint(1, 97, (1, 320), generator=torch.Generator().manual_seed(7))
    matrices = compute_transforms(model, collect_moments(model, ids, 64), 32, 0.01)
    meta = {"model": "", "layers": "2", "kv_heads": "2", "head_dim": "32", "block": "32",
            "damping": "0.01", "data": "random", "tokens": "320"}
    path = tmp_path_factory.mktemp("wush") / "transforms.safetensors"
    return save_transforms(path, TransformSet(matrices["keys"], matrices["values"], meta))


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_quest_levels_and_clip_scales_match_the_constants(bits):
    x = gaussian(1, 4, 256)
    q = quest_quantize(x, bits)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    alpha = QUEST_CLIP[bits] * rms
    step = 2 * alpha / (2**bits - 1)
    torch.testing.assert_close(q.step.float(), step, rtol=1e-3, atol=0)
    levels = quest_dequantize(q)
    expected = (torch.arange(2**bits) - 2 ** (bits - 1) + 0.5)  # in units of the step
    assert set((levels / q.step.float()).round(decimals=3).unique().tolist()) <= set(
        expected.tolist())
    assert levels.abs().max() <= alpha.max() * 1.001  # the outermost level is α = c_b·RMS
    if bits == 1:
        torch.testing.assert_close(levels.abs(), alpha.expand_as(levels), rtol=1e-3, atol=0)


def test_quest_one_and_two_bit_errors_are_the_gaussian_optima():
    x = gaussian(8, 1, 8192)
    mse = {b: (quest_dequantize(quest_quantize(x, b)) - x).pow(2).mean().item() for b in (1, 2)}
    assert mse[1] == pytest.approx(1 - 2 / math.pi, rel=0.03)
    assert mse[2] == pytest.approx(0.1188, rel=0.05)


@pytest.mark.parametrize("percentile", [1.0, 5.0, 12.5])
def test_percentile_clipping_clips_exactly_the_stated_fraction(percentile):
    x = gaussian(3, 2, 200)
    lo, hi = percentile_bounds(x, percentile)
    k = round(percentile / 100 * 200)
    assert ((x < lo).sum(-1) == k).all() and ((x > hi).sum(-1) == k).all()
    x_hat = dequantize(percentile_quantize(x, 4, percentile))
    clipped = (x < lo) | (x > hi)
    assert (x_hat >= lo - 1e-2).all() and (x_hat <= hi + 1e-2).all()  # float16 bounds
    step = (hi - lo) / 15
    assert ((x_hat - x).abs()[~clipped] <= (step / 2 + 1e-3).expand_as(x)[~clipped]).all()
    assert ((x_hat - x).abs()[clipped] > 0).all()


@pytest.mark.parametrize("kind", KINDS)
def test_scores_are_preserved_through_the_real_cache(model, transforms_file, kind):
    """The float32 matrices the cache and the hook really use keep q·k: keys stored in the
    residual (full precision, transformed) against queries transformed by the hook."""
    method = f"wush:transforms={transforms_file},transform={kind},{LAYOUT},residual_dtype=float32"
    cache = kvmix.make_cache(prepare_model(model, method), method)
    keys, values, queries = gaussian(1, 2, 10, 32), gaussian(1, 2, 10, 32), gaussian(1, 4, 1, 32)
    cache.update(keys, values, 1)
    attend(cache, queries.expand(1, 4, 10, 32).contiguous())
    row = cache.layers[1].rows[0]
    stored = torch.cat([row.sink_keys, row.res_keys], 2)  # [1, 2, 10, 32]
    moved = cache.method.transform_queries(queries, 1)  # what the hook hands the layer
    exact = queries @ keys.repeat_interleave(2, 1).transpose(-1, -2)
    through = moved @ stored.repeat_interleave(2, 1).transpose(-1, -2)
    torch.testing.assert_close(through, exact, rtol=1e-4, atol=1e-4)
    assert kind == "identity" or not torch.allclose(stored, keys, atol=1e-2)


def test_wush_is_not_the_identity(transforms_file):
    loaded = load_transforms(transforms_file)
    eye = torch.eye(32, dtype=torch.float64)
    assert not torch.allclose(loaded.keys["wush"][0, 0], eye, atol=0.1)
    torch.testing.assert_close(loaded.keys["hadamard"][0, 0], hadamard(32, torch.float64))
    torch.testing.assert_close(loaded.keys["identity"][1, 1], eye)


@pytest.mark.parametrize("kind", KINDS)
def test_folded_values_with_an_exact_cache_keep_the_logits(model, transforms_file, kind):
    method = f"wush:transforms={transforms_file},transform={kind},{LAYOUT}"
    folded = prepare_model(model, method)
    assert folded is not model and prepare_model(model, method) is folded  # made once
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        original = model(ids).logits
        torch.testing.assert_close(folded(ids).logits, original, rtol=0, atol=1e-4)
    v = model.model.layers[0].self_attn.v_proj.weight
    assert not torch.equal(folded.model.layers[0].self_attn.v_proj.weight, v) or kind == "identity"


def test_identity_with_enough_bits_approaches_full(model, transforms_file):
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(2))
    results = {}
    for spec in ("full", f"wush:transforms={transforms_file},transform=identity,key_bits=8,"
                         f"value_bits=8,{LAYOUT}",
                 f"wush:transforms={transforms_file},transform=identity,key_bits=2,"
                 f"value_bits=2,{LAYOUT}"):
        runner = prepare_model(model, spec)
        cache = kvmix.make_cache(runner, spec)
        with torch.no_grad():
            runner(ids, cache=cache, use_cache=True)
            results[spec[:4] + spec[-30:]] = runner(ids[:, :6], cache=cache).logits
        assert cache.nbytes() == cache.theoretical_nbytes()
    full, eight, two = results.values()
    assert (eight - full).abs().max() < 0.02 < (two - full).abs().max()


def test_wush_error_is_no_worse_than_hadamard_on_known_gaussians():
    torch.manual_seed(0)
    dim = 32
    mixing = torch.randn(dim, dim, dtype=torch.float64) * torch.logspace(0, -2, dim,
                                                                         dtype=torch.float64)
    sigma = mixing @ mixing.T
    weight = torch.randn(48, dim, dtype=torch.float64) * torch.logspace(-1, 1, dim,
                                                                        dtype=torch.float64)
    x = torch.randn(4096, dim, dtype=torch.float64) @ torch.linalg.cholesky(sigma).T
    error = {}
    for kind in ("hadamard", "wush"):
        t = block_transform(sigma, weight, kind, dim, 1e-6)
        moved = (x @ t.T).float().view(1, 1, -1, dim)
        x_hat = quest_dequantize(quest_quantize(moved, 2)).double().view(-1, dim)
        x_hat = x_hat @ torch.linalg.inv(t).T
        error[kind] = ((x_hat - x) @ weight.T).pow(2).mean().item()
    assert error["wush"] <= error["hadamard"]


def test_singular_moments_are_damped_and_the_damping_is_recorded(transforms_file):
    sigma = torch.zeros(8, 8, dtype=torch.float64)
    sigma[0, 0] = 1.0  # rank one
    t = block_transform(sigma, torch.randn(5, 8, dtype=torch.float64), "wush", 8, 0.01)
    assert torch.isfinite(t).all() and torch.linalg.matrix_rank(t) == 8
    with safe_open(str(transforms_file), framework="pt") as handle:
        assert handle.metadata()["damping"] == "0.01"


def test_export_writes_block_multipliers(tmp_path, transforms_file):
    path = save_multipliers(tmp_path / "right.safetensors", load_transforms(transforms_file),
                            "wush")
    with safe_open(str(path), framework="pt") as handle:
        assert set(handle.keys()) == {"k_right", "q_right", "v_right", "o_right"}
        assert handle.get_tensor("k_right").shape == (2, 2, 1, 32, 32)
        assert "layout" in handle.metadata()


def test_bad_wush_input(model, transforms_file, tmp_path):
    with pytest.raises(ValueError, match="wush needs transforms=PATH"):
        parse_method("wush")
    with pytest.raises(ValueError, match="no such file"):
        parse_method(f"wush:transforms={tmp_path}/missing.safetensors")
    with pytest.raises(ValueError, match="transform='best' is invalid"):
        parse_method(f"wush:transforms={transforms_file},transform=best")
    with pytest.raises(ValueError, match="needs the model with its value transforms folded"):
        kvmix.make_cache(model, f"wush:transforms={transforms_file},{LAYOUT}")
    other = tiny_llama(num_hidden_layers=3)
    with pytest.raises(ValueError, match=r"were calibrated for model '' \(2 layers"):
        kvmix.make_cache(other, f"wush:transforms={transforms_file},{LAYOUT}")
    with pytest.raises(ValueError, match="block=12 must divide the head dim 32"):
        block_transform(torch.eye(32, dtype=torch.float64), torch.eye(32, dtype=torch.float64),
                        "wush", 12, 0.01)
    damaged = tmp_path / "damaged.safetensors"
    loaded = load_transforms(transforms_file)
    loaded.keys["wush"] = loaded.keys["wush"] * 1.0001
    from safetensors.torch import save_file

    save_file(loaded.tensors(), str(damaged), metadata={**loaded.meta,
                                                       "checksum": "0" * 64})
    with pytest.raises(ValueError, match="checksum mismatch"):
        load_transforms(damaged)


def test_folding_in_place_changes_the_model_itself_once(transforms_file):
    """``inplace=True``: no second copy of the weights; the model is folded and marked, a
    second fold for the same transforms is a no-op, for other transforms an error."""
    model = tiny_llama(seed=7)
    reference = tiny_llama(seed=7)
    method = f"wush:transforms={transforms_file},transform=wush,{LAYOUT}"
    copy = prepare_model(reference, method)  # the default: a folded copy
    ids = torch.randint(1, 97, (1, 30), generator=torch.Generator().manual_seed(1))
    assert prepare_model(model, method, inplace=True) is model
    assert prepare_model(model, method, inplace=True) is model  # already folded: a no-op
    weight = model.model.layers[0].self_attn.v_proj.weight
    assert torch.equal(weight, copy.model.layers[0].self_attn.v_proj.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-4)
    other = f"wush:transforms={transforms_file},transform=hadamard,{LAYOUT}"
    with pytest.raises(ValueError, match=r"already folded in place .* load the model again"):
        prepare_model(model, other, inplace=True)
    cache = kvmix.make_cache(model, method)  # binds: the model carries the transforms' id
    assert cache.method.fold_id == model._kvmix_folded


def test_the_models_facts_are_computed_once_and_again_after_an_in_place_change(monkeypatch):
    from kvmix.runtime import attention

    calls = []
    probe = attention.rope_pairs
    monkeypatch.setattr(attention, "rope_pairs", lambda m: calls.append(m) or probe(m))
    model = tiny_llama(seed=3)
    first = kvmix.make_cache(model, "kivi2").spec.kv_norms
    kvmix.make_cache(model, "pnmix1")
    assert len(calls) == 1  # the RoPE probe and the norms: once per model
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(2)  # changed in place
    again = kvmix.make_cache(model, "kivi2").spec.kv_norms
    assert len(calls) == 2
    torch.testing.assert_close(again[1, 0], 4 * first[1, 0])
    assert torch.equal(again[0], first[0])
