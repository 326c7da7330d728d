"""Engine-format methods: ``ggml`` bit for bit against gguf-py's implementation of llama.cpp's
quantizers (the reference its maintainers test against the C code), in llama.cpp's channel
order; block bytes as the engine stores them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers import PAIRS, make, tokens

from kvmix.methods.ggml import FORMATS, dequantize_blocks, format_bits, quantize_blocks

TYPES = {name: getattr(GGMLQuantizationType, name.upper()) for name in FORMATS}


def engine(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What llama.cpp stores for ``x`` [..., D] and reads back (float32)."""
    kind = TYPES[kind]
    return torch.from_numpy(quants.dequantize(quants.quantize(x.numpy(), kind), kind))


def values_of_every_scale() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 64, generator=g) * torch.tensor([1e-3, 1.0, 60.0])[:, None, None]
    x[0, 0, 0, :32] = 0.25  # a constant block
    x[0, 0, 1, :32] = 0.0  # an all-zero block: scale 0
    x[1, 1, 2, 5] = -x[1, 1, 2, :32].abs().max()  # ties of magnitude: the first one counts
    x[1, 1, 2, 9] = -x[1, 1, 2, 5]
    return x


@pytest.mark.parametrize("kind", list(FORMATS))
def test_blocks_are_llama_cpp_blocks(kind):
    x = values_of_every_scale()
    stored = quantize_blocks(x, kind)
    rows = stored[:, None] if kind == "f16" else type(stored)(
        *(None if t is None else t[:, None] for t in (stored.codes, stored.scale,
                                                       stored.minimum)))
    got = dequantize_blocks(rows, kind, tuple(x.shape[1:]), torch.float32)[:, 0]
    assert torch.equal(got, engine(x, kind))
    if kind != "f16":  # codes and statistics take what the engine's block takes
        kept = stored.codes.nbytes + stored.scale.nbytes + (
            0 if stored.minimum is None else stored.minimum.nbytes)
        engine_bytes = len(quants.quantize(x.numpy(), TYPES[kind]).tobytes())
        assert kept == engine_bytes == x.numel() * format_bits(kind) / 8


def test_the_cache_stores_keys_in_the_engines_channel_order():
    cache = make("ggml:k=q4_0,v=q5_1,rotate=none", sink=0, residual=8, group=8)
    keys, values, queries = tokens(1, 16, seed=2, dtype=torch.float32)
    cache.update(keys, values, 0)
    from helpers import attend

    attend(cache, queries)
    row = cache.layers[0].rows[0]
    decoded_keys, decoded_values = row.decode_blocks(torch.float32)  # [1, H, 16, D]
    assert decoded_keys.shape[2] == 16  # every token in blocks: no float residual is left
    interleaved = PAIRS.flatten()  # llama.cpp's order for Llama GGUF files
    expected = engine(keys[..., interleaved], "q4_0")[..., interleaved.argsort()]
    assert torch.equal(decoded_keys, expected)
    assert torch.equal(decoded_values, engine(values, "q5_1"))


def test_key_blocks_follow_the_engines_channel_order():
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    dim = 64  # two blocks of 32 per head: the order decides which channels share a scale
    pairs = torch.stack([torch.arange(dim // 2), torch.arange(dim // 2, dim)], 1)
    keys = torch.randn(1, 2, 4, dim, generator=torch.Generator().manual_seed(3))
    keys[..., dim // 2:] *= 20  # the second half of the channels is larger
    decoded = {}
    for order in ("pairs", "model"):
        method = parse_method(f"ggml:k=q4_0,v=f16,key_order={order},rotate=none,residual=4,"
                              "group=4")
        method.bind(ModelSpec(1, 2, 2, dim, pairs))
        stored = map_tensors(Blocks(*method.encode(keys, keys, 0, None)), lambda t: t[:, None])
        decoded[order] = method.decode(stored, 0, None, torch.float32)[0][:, 0]
    interleaved = pairs.flatten()
    assert torch.equal(decoded["pairs"], engine(keys[..., interleaved], "q4_0")[
        ..., interleaved.argsort()])
    assert torch.equal(decoded["model"], engine(keys, "q4_0"))
    assert not torch.equal(decoded["pairs"], decoded["model"])


def test_unknown_types_are_named_with_the_valid_ones():
    from kvmix.methods import parse_method

    with pytest.raises(ValueError, match="k='iq4_nl' is invalid; valid: f16, q8_0"):
        parse_method("ggml:k=iq4_nl")
    with pytest.raises(ValueError, match="key_order='x' is invalid; valid: pairs, model"):
        parse_method("ggml:key_order=x")
    assert np.isclose(format_bits("q4_1"), 5.0)


def test_rotation_is_llama_cpps_hadamard_on_each_quantized_side():
    """Since llama.cpp#21038 the engine stores H·x for a quantized side (in its channel order)
    and rotates the output back: x̂ = H·Q(H·x)."""
    from kvmix.core.transforms import hadamard
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    dim = 64
    pairs = torch.stack([torch.arange(dim // 2), torch.arange(dim // 2, dim)], 1)
    g = torch.Generator().manual_seed(5)
    keys, values = torch.randn(2, 1, 2, 4, dim, generator=g)
    keys[..., 3] *= 30  # an outlier channel: rotation spreads it
    method = parse_method("ggml:k=q4_0,v=f16,residual=4,group=4")
    spec = ModelSpec(1, 2, 2, dim, pairs)
    method.bind(spec)
    stored = map_tensors(Blocks(*method.encode(keys, values, 0, None)), lambda t: t[:, None])
    k, v = (x[:, 0] for x in method.decode(stored, 0, None, torch.float32))
    h, order = hadamard(dim), pairs.flatten()
    expected = (engine(keys[..., order] @ h, "q4_0") @ h)[..., order.argsort()]
    torch.testing.assert_close(k, expected, rtol=0, atol=1e-5)
    assert torch.equal(v, values.half().float())  # f16: never rotated
    plain = parse_method("ggml:k=q4_0,v=f16,rotate=none,residual=4,group=4")
    plain.bind(spec)
    kept = map_tensors(Blocks(*plain.encode(keys, values, 0, None)), lambda t: t[:, None])
    unrotated = plain.decode(kept, 0, None, torch.float32)[0][:, 0]
    assert (k - keys).pow(2).mean() < (unrotated - keys).pow(2).mean()  # outliers spread
    assert method.static_nbytes(spec) == 4 * dim * dim and plain.static_nbytes(spec) == 0


def fp8_roundtrip(x: torch.Tensor, **options) -> torch.Tensor:
    """x [1, H, T, D] through an fp8 method: scales from x itself (the prompt), then blocks."""
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    text = ",".join(f"{k}={v}" for k, v in options.items())
    method = parse_method(f"fp8:{text},residual={x.shape[2]},group={x.shape[2]}")
    method.bind(ModelSpec(1, x.shape[1], x.shape[1], x.shape[3]))
    scales = method.select(x, x, 0, x)
    stored = map_tensors(Blocks(*method.encode(x, x, 0, scales)), lambda t: t[:, None])
    return method.decode(stored, 0, scales, torch.float32)[0][:, 0]


def test_fp8_scales_put_each_heads_largest_value_at_the_formats_largest_code():
    x = torch.randn(1, 2, 16, 32, generator=torch.Generator().manual_seed(4))
    x[:, 1] *= 1e4  # heads of very different ranges: one scale drives head 0 subnormal
    per_head = fp8_roundtrip(x, scale="head")
    amax = x.abs().amax(dim=(2, 3))
    torch.testing.assert_close(per_head.abs().amax(dim=(2, 3)), amax)
    for head in range(2):  # e4m3 keeps 3 mantissa bits: a relative error under 2^-4 for
        big = x[0, head].abs() > amax[0, head] / 64  # values in the normal range
        assert ((per_head - x).abs()[0, head][big] / x[0, head].abs()[big]).max() <= 2**-4
    one_scale = fp8_roundtrip(x, scale="tensor")  # head 0's values go subnormal under it
    assert (per_head - x)[:, 0].abs().mean() < (one_scale - x)[:, 0].abs().mean()
    e5m2 = fp8_roundtrip(x, scale="head", format="e5m2")
    assert (e5m2 - x).abs().mean() > (per_head - x).abs().mean()  # 2 mantissa bits, not 3


def test_fp8_without_scales_saturates_like_an_uncalibrated_engine():
    x = torch.tensor([1000.0, -1000.0, 3.0, 0.5]).repeat(8).view(1, 1, 1, 32)
    decoded = fp8_roundtrip(x, scale="one")
    assert decoded[0, 0, 0, :4].tolist() == [448.0, -448.0, 3.0, 0.5]


def test_fp8_bad_names_list_the_valid_ones():
    from kvmix.methods import parse_method

    with pytest.raises(ValueError, match="format='e3m4' is invalid; valid: e4m3, e5m2"):
        parse_method("fp8:format=e3m4")
    with pytest.raises(ValueError, match="scale='block' is invalid; valid: tensor, head, one"):
        parse_method("fp8:scale=block")


# -- the nearest engine setting, plans and their refusal --------------------------------------


def test_nearest_settings_cover_the_plan_and_say_what_they_cannot_express():
    from kvmix.evaluation.engines import nearest
    from kvmix.methods import parse_method

    method = parse_method("kivi4")  # 5 bits per key and value element, per-channel keys
    settings = nearest(method, [(5.0, 5.0)] * 4)
    assert settings["llama.cpp"].flags == ["-ctk", "q4_1", "-ctv", "q4_1", "-fa", "on"]
    assert settings["llama.cpp"].simulate == "ggml:k=q4_1,v=q4_1"
    assert settings["vllm"].setting == "fp8_e4m3" and settings["sglang"].setting == "fp8_e4m3"
    cannot = " ".join(settings["vllm"].cannot)
    assert "per-channel key groups" in cannot and "float residual of up to 128" in cannot
    assert "keys at 5 bits: the engine's nearest format takes 8" in cannot
    assert "per-layer widths" not in cannot  # every layer is alike


def test_vllm_leaves_wider_layers_unquantized_and_llama_cpp_covers_the_widest():
    from kvmix.evaluation.engines import nearest
    from kvmix.methods import parse_method

    layers = [(4.5, 4.5), (4.5, 4.5), (8.5, 8.5), (4.5, 4.5)]
    settings = nearest(parse_method("ggml:k=q4_0,v=q4_0"), layers)
    assert settings["vllm"].setting == "fp8_e4m3"  # covers the median layer
    assert settings["vllm"].skip_layers == [2]  # 8.5 bits: more than float8 keeps
    assert settings["vllm"].flags[-2:] == ["--kv-cache-dtype-skip-layers", "2"]
    assert settings["llama.cpp"].setting == "q8_0/q8_0"
    assert any("per-layer widths" in c for c in settings["llama.cpp"].cannot)
    assert settings["vllm"].simulate == "fp8:format=e4m3,scale=tensor"


def test_engine_flags_of_the_engines_own_formats():
    from kvmix.evaluation.engines import engine_flags

    assert engine_flags("ggml:k=q8_0,v=q4_0") == {
        "llama.cpp": ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]}
    assert engine_flags("fp8:format=e5m2")["sglang"] == ["--kv-cache-dtype", "fp8_e5m2"]
    assert engine_flags("kivi2") == {}


def test_a_plan_names_its_model_and_is_refused_by_another(tmp_path):
    from conftest import tiny_llama

    from kvmix.evaluation.plans import load_plan, make_plan, save_plan
    from kvmix.models.loading import LoadedModel

    loaded = LoadedModel(tiny_llama(seed=0), None, "tiny", "test", torch.float32)
    plan = make_plan(loaded, "pnmix1")
    assert [layer["layer"] for layer in plan["layers"]] == [0, 1]
    assert plan["layout"] == {"sink": 32, "residual": 128, "group": 128}
    assert set(plan["engines"]) == {"llama.cpp", "vllm", "sglang"}
    assert plan["engines"]["llama.cpp"]["flags"][:2] == ["-ctk", "q4_0"]
    path = save_plan(tmp_path, plan)
    assert load_plan(path, loaded.model) == "pnmix1"
    other = tiny_llama(seed=1)  # same architecture, other weights
    with pytest.raises(ValueError, match="was made for model 'tiny' \\(fingerprint"):
        load_plan(path, other)
