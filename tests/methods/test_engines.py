"""Engine-format methods: ``ggml`` bit for bit against gguf-py's implementation of llama.cpp's
quantizers (the reference its maintainers test against the C code), in llama.cpp's channel
order; block bytes as the engine stores them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers import METHODS, PAIRS, D, make, tokens

from kvmix.methods.ggml import FLOATS, FORMATS, dequantize_blocks, format_bits, quantize_blocks
from kvmix.runtime.store import stored as as_stored

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
    rows = stored[:, None] if kind in FLOATS else type(stored)(
        *(None if t is None else t[:, None] for t in (stored.codes, stored.scale,
                                                       stored.minimum)))
    got = dequantize_blocks(rows, kind, tuple(x.shape[1:]), torch.float32)[:, 0]
    assert torch.equal(got, engine(x, kind))
    if kind not in FLOATS:  # codes and statistics take what the engine's block takes
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
    keys, values = as_stored(keys, cache.method), as_stored(values, cache.method)  # as entered
    assert torch.equal(decoded_keys, engine(keys[..., interleaved], "q4_0"))  # its frame
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
        entered = method.transform_keys(keys, 0)  # the engine's frame
        stored = map_tensors(Blocks(*method.encode(entered, keys, 0, None)),
                             lambda t: t[:, None])
        decoded[order] = method.decode(stored, 0, None, torch.float32)[0][:, 0]
    interleaved = pairs.flatten()
    assert torch.equal(decoded["pairs"], engine(keys[..., interleaved], "q4_0"))
    assert torch.equal(decoded["model"], engine(keys, "q4_0"))
    assert not torch.equal(decoded["pairs"], decoded["model"])


def test_unknown_types_are_named_with_the_valid_ones():
    from kvmix.methods import parse_method

    with pytest.raises(ValueError, match="k='iq4_nl' is invalid; valid: f16, bf16, q8_0"):
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

    def model_frame_keys(method) -> torch.Tensor:
        """Keys through the cache (entering in the engine's frame), back in the model's."""
        entered = method.transform_keys(keys, 0)
        stored = map_tensors(Blocks(*method.encode(entered, values, 0, None)),
                             lambda t: t[:, None])
        k, v = (x[:, 0] for x in method.decode(stored, 0, None, torch.float32))
        assert torch.equal(v, values.half().float())  # f16: never rotated
        unrotated = k @ hadamard(dim) if method.rotation["k"] else k
        return unrotated[..., order.argsort()]

    h, order = hadamard(dim), pairs.flatten()
    k = model_frame_keys(method)
    expected = (engine(keys[..., order] @ h, "q4_0") @ h)[..., order.argsort()]
    torch.testing.assert_close(k, expected, rtol=0, atol=1e-5)
    plain = parse_method("ggml:k=q4_0,v=f16,rotate=none,residual=4,group=4")
    plain.bind(spec)
    unrotated = model_frame_keys(plain)
    assert (k - keys).pow(2).mean() < (unrotated - keys).pow(2).mean()  # outliers spread


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
    from kvmix.engines.nearest import nearest
    from kvmix.methods import parse_method

    method = parse_method("kivi4")  # 5 bits per key and value element, per-channel keys
    settings = nearest(method, [(5.0, 5.0)] * 4, head_dim=64)
    assert settings["llama.cpp"].flags == ["-ctk", "q4_1", "-ctv", "q4_1", "-fa", "on"]
    assert settings["llama.cpp"].simulate == "ggml:k=q4_1,v=q4_1"
    # 8 bits: float8 before int8_per_token_head (8.5 bits at head dim 64); the explicit name
    assert settings["vllm"].setting == "fp8_e4m3" and settings["sglang"].setting == "fp8_e4m3"
    cannot = " ".join(settings["vllm"].cannot)
    assert "per-channel key groups" in cannot and "float residual of up to 128" in cannot
    assert "keys at 5 bits: the engine's nearest format takes 8" in cannot
    assert "per-layer widths" not in cannot  # every layer is alike
    assert settings["vllm"].fidelity.startswith("measured") and settings["vllm"].release


def test_vllm_leaves_wider_layers_unquantized_and_llama_cpp_covers_the_widest():
    from kvmix.engines.nearest import nearest
    from kvmix.methods import parse_method

    layers = [(4.5, 4.5), (4.5, 4.5), (8.5, 8.5), (4.5, 4.5)]
    settings = nearest(parse_method("ggml:k=q4_0,v=q4_0"), layers, head_dim=64)
    # the median layer: vLLM's int4_per_token_head (4 + 32/64 bits per side), simulated
    assert settings["vllm"].setting == "int4_per_token_head"
    assert settings["vllm"].simulate == "pertoken:format=int4_per_token_head"
    assert settings["vllm"].skip_layers == [2]  # 8.5 bits: more than the format keeps
    assert settings["vllm"].flags[-2:] == ["--kv-cache-dtype-skip-layers", "2"]
    assert settings["llama.cpp"].setting == "q8_0/q8_0"
    assert any("per-layer widths" in c for c in settings["llama.cpp"].cannot)
    # 3-bit layers at head dim 128: TurboQuant's 3-bit mode (3 + 16/128, 3 + 32/128 bits), whose
    # bits come from vLLM's source; kvmix does not simulate it
    turbo = nearest(parse_method("kivi2"), [(3.1, 3.2)] * 4, head_dim=128)["vllm"]
    assert turbo.setting == "turboquant_3bit_nc"
    assert (turbo.key_bits, turbo.value_bits) == (3.125, 3.25)
    assert turbo.simulate is None and "from the source" in turbo.fidelity


def test_engine_flags_of_the_engines_own_formats():
    from kvmix.engines.nearest import engine_flags

    assert engine_flags("ggml:k=q8_0,v=q4_0") == {
        "llama.cpp": ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]}
    assert engine_flags("fp8:format=e5m2")["sglang"] == ["--kv-cache-dtype", "fp8_e5m2"]
    assert engine_flags("vllm-int8") == {"vllm": ["--kv-cache-dtype", "int8_per_token_head"]}
    assert engine_flags("pertoken:format=mxfp8") == {}  # SGLang's FA4 backend only
    assert engine_flags("kivi2") == {}


def emitted(setting) -> list[str]:
    """The format names a setting's flags pass to the engine."""
    flags = setting.flags
    names = [flags[i + 1] for i, flag in enumerate(flags) if flag in ("-ctk", "-ctv",
                                                                     "--kv-cache-dtype")]
    assert names, flags
    return names


@pytest.mark.parametrize("name", METHODS)
def test_every_flag_a_plan_emits_is_one_its_engine_release_accepts(name):
    """Every method, every known release of every engine, head dims 32 to 256: the emitted
    values are among the release's accepted ones, skipped layers exist, and the flags of every
    format kvmix simulates name an accepted value."""
    from kvmix.engines.formats import RELEASES
    from kvmix.engines.nearest import engine_flags, nearest

    method = make(name).method
    layers = [method.bits(i, torch.float32) for i in range(2)]
    for engine, known in RELEASES.items():
        for version, release in known.items():
            for head_dim in (32, 80, 128, 256):
                setting = nearest(method, layers, head_dim, {engine: version})[engine]
                assert setting.release == version
                assert set(emitted(setting)) <= set(release.accepted), (engine, version)
                assert all(0 <= i < len(layers) for i in setting.skip_layers)
            for fmt in release.formats:
                if fmt.simulate:
                    flags = engine_flags(fmt.simulate, {engine: version}).get(engine, [])
                    assert set(flags[1::2][:2]) <= set(release.accepted), fmt.name


def test_the_tables_hold_each_releases_accepted_values():
    """As read from the releases' sources (vllm/config/cache.py CacheDType; sglang's
    --kv-cache-dtype choices; llama.cpp's common/arg.cpp kv_cache_types)."""
    from kvmix.engines.formats import RELEASES

    vllm = {"auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
            "fp8_ds_mla", "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc",
            "turboquant_k3v4_nc", "turboquant_3bit_nc", "octave_k3v4", "octave_k3v3",
            "octave_k3v3_compact", "ultraquant_4bit", "int4_per_token_head",
            "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6"}
    sglang = {"auto", "fp8_e5m2", "fp8_e4m3", "mxfp8", "bf16", "bfloat16", "nvfp4",
              "fp4_mx_block16"}
    assert set(RELEASES["vllm"]["0.33.0"].accepted) == vllm
    assert set(RELEASES["sglang"]["0.5.23"].accepted) == sglang
    assert set(RELEASES["sglang"]["0.5.20"].accepted) == sglang | {"fp4_e2m1"}
    assert set(RELEASES["llama.cpp"]["0.3.36"].accepted) == {
        "f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}
    for known in RELEASES.values():
        for release in known.values():
            for fmt in release.formats:  # a simulated format's bits are the method's own
                if fmt.simulate and fmt.simulate != "full":
                    method = make(fmt.simulate).method
                    assert method.bits(0, torch.float32) == fmt.bits(D), fmt.name


def test_an_unknown_engine_release_is_refused_listing_the_known_ones():
    from kvmix.engines.formats import parse_versions

    assert parse_versions("sglang=0.5.20") == {"sglang": "0.5.20"}
    with pytest.raises(ValueError, match=r"sglang release '0.5.19' is unknown; known: 0.5.23, "
                                         r"0.5.20"):
        parse_versions("sglang=0.5.19")
    with pytest.raises(ValueError, match=r"engine .tgi. is unknown; known: llama\.cpp, vllm"):
        parse_versions("tgi=1.0")
    with pytest.raises(ValueError, match="engine_version='sglang' is invalid"):
        parse_versions("sglang")


def test_a_plan_names_its_model_and_is_refused_by_another(tmp_path):
    from conftest import tiny_llama

    from kvmix.engines.kv_plan import load_plan, make_plan, save_plan
    from kvmix.models.loading import LoadedModel

    loaded = LoadedModel(tiny_llama(seed=0), None, "tiny", "test", torch.float32)
    plan = make_plan(loaded, "pnmix1", {"sglang": "0.5.20"})
    assert plan["engine_releases"] == {"llama.cpp": "0.3.36", "vllm": "0.33.0",
                                       "sglang": "0.5.20"}
    assert [layer["layer"] for layer in plan["layers"]] == [0, 1]
    assert plan["layout"] == {"sink": 32, "residual": 128, "group": 128}
    assert set(plan["engines"]) == {"llama.cpp", "vllm", "sglang"}
    assert plan["engines"]["llama.cpp"]["flags"][:2] == ["-ctk", "q4_0"]
    path = save_plan(tmp_path, plan)
    assert load_plan(path, loaded.model) == "pnmix1"
    other = tiny_llama(seed=1)  # same architecture, other weights
    with pytest.raises(ValueError, match="was made for model 'tiny' \\(fingerprint"):
        load_plan(path, other)


# -- vLLM's per-token-head modes and SGLang's mxfp8 (``pertoken``) ----------------------------


def pertoken_roundtrip(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, object]:
    """x [1, H, 1, D] through the method's encode/decode: what the engine reads back, and the
    keys' stored state."""
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    method = parse_method(f"pertoken:format={kind}")
    method.bind(ModelSpec(1, x.shape[1], x.shape[1], x.shape[-1]))
    keys, values = method.encode(x, x, 0, None)
    stored = map_tensors(Blocks(keys, values), lambda t: t[:, None])
    return method.decode(stored, 0, None, torch.float32)[0][:, 0], keys


def test_int8_per_token_head_rounds_half_away_from_zero_with_one_scale_per_head():
    """vLLM adds ±½ and lets the int8 store truncate: halves go away from zero (round-half-even
    would send 0.5 and −2.5 to 0 and −2); the largest magnitude takes code 127."""
    s = 2.0  # amax 254 -> scale 254/127 = 2
    row = torch.tensor([254.0, 1.0, -5.0, 3.0, -1.0, 0.2] + [0.0] * 26)
    x = torch.stack([row, row / 8])[None, :, None]  # two heads, [1, 2, 1, 32]
    got, stored = pertoken_roundtrip(x, "int8_per_token_head")
    assert torch.equal(stored.scale[0, :, 0], torch.tensor([s, s / 8]))
    codes = stored.codes.view(torch.int8)[0, 0, 0, :6].tolist()
    assert codes == [127, 1, -3, 2, -1, 0]  # 0.5 -> 1, -2.5 -> -3, 1.5 -> 2, -0.5 -> -1
    assert torch.equal(got[0, 1], got[0, 0] / 8)  # each head its own scale
    zero = pertoken_roundtrip(torch.zeros(1, 1, 1, 32), "int8_per_token_head")[1]
    assert zero.scale.item() == pytest.approx(1e-6)  # vLLM's floor: no division by zero


def test_fp8_per_token_head_puts_each_heads_largest_value_at_448():
    x = torch.randn(1, 3, 1, 64, generator=torch.Generator().manual_seed(2))
    x[:, 1] *= 1e3
    got, stored = pertoken_roundtrip(x, "fp8_per_token_head")
    amax = x.abs().amax(-1)
    torch.testing.assert_close(stored.scale, amax / 448)
    torch.testing.assert_close(got.abs().amax(-1), amax)
    assert ((got - x).abs() <= x.abs() * 2**-4 + amax[..., None] / 448 * 2**-9).all()


def test_int4_per_token_head_hides_the_zero_point_in_the_scale_and_rotates_back():
    """vLLM's randomized Hadamard transform (unnormalized, with its ±1 signs) before an
    asymmetric 4-bit code per token and head; the zero point sits in the scale's low 4 mantissa
    bits and the scale is read back without them."""
    from kvmix.core.transforms import hadamard
    from kvmix.methods.pertoken import dequantize, quantize, rht, rht_signs

    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 2, 1, 64, generator=g)
    x[..., 7] += 12  # an outlier channel: the rotation spreads it
    signs = rht_signs(64)
    assert set(signs.tolist()) == {-1.0, 1.0}
    rotated = rht(x, signs)
    torch.testing.assert_close(rotated, (x * signs) @ hadamard(64) * 8)  # unnormalized
    torch.testing.assert_close(rht(rotated, signs, inverse=True), x)  # H·H = 64·I
    stored = quantize(rotated, "int4_per_token_head")
    bits = stored.scale.view(torch.int32)
    lo, hi = rotated.amin(-1), rotated.amax(-1)
    exact = (hi - lo) / 15
    assert torch.equal(bits & 15, (-lo / exact + 0.5).trunc().int().clamp(0, 15))
    assert torch.equal(bits & -16, exact.view(torch.int32) & -16)
    got, _ = pertoken_roundtrip(x, "int4_per_token_head")
    read = dequantize(type(stored)(stored.codes[:, None], stored.scale[:, None]),
                      "int4_per_token_head", (2, 1, 64))[:, 0]
    torch.testing.assert_close(got, rht(read, signs, inverse=True))
    unrotated = dequantize(type(stored)(*(t[:, None] for t in (
        quantize(x, "int4_per_token_head").codes, quantize(x, "int4_per_token_head").scale))),
        "int4_per_token_head", (2, 1, 64))[:, 0]
    assert (got - x).pow(2).mean() < (unrotated - x).pow(2).mean()  # outliers spread


def test_mxfp8_takes_the_smallest_power_of_two_scale_that_fits_448():
    x = torch.randn(1, 1, 1, 64, generator=torch.Generator().manual_seed(6)) * 37
    got, stored = pertoken_roundtrip(x, "mxfp8")
    amax = x.view(2, 32).abs().amax(-1)
    scale = torch.exp2(stored.scale.float().view(2))  # a power of two per 32 channels
    assert ((amax / scale <= 448) & (amax / scale > 224)).all()
    assert ((got - x).abs().view(2, 32) <= x.abs().view(2, 32) * 2**-4 + scale[:, None]
            * 2**-9).all()


# -- llama.cpp's query rounding and rotation blocks -------------------------------------------


def test_the_query_is_rounded_as_llama_cpps_flash_attention_rounds_it():
    """Against q4_0 keys the engine dots q8_0 codes of the rotated, reordered query with the
    key blocks: the cache's scores are Q8(H·P·q)·Q(H·P·k), and equal q·k without rounding."""
    from kvmix.core.transforms import hadamard
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    dim = 64
    pairs = torch.stack([torch.arange(dim // 2), torch.arange(dim // 2, dim)], 1)
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 1, 1, dim, generator=g)
    query = torch.randn(1, 2, 3, dim, generator=g)
    spec = ModelSpec(1, 2, 1, dim, pairs)

    def scores(text: str) -> torch.Tensor:
        method = parse_method(text)
        method.bind(spec)
        entered = method.transform_keys(keys, 0)
        stored = map_tensors(Blocks(*method.encode(entered, entered, 0, None)),
                             lambda t: t[:, None])
        k = method.decode(stored, 0, None, torch.float32)[0][:, 0]  # [1, 1, 1, D]
        return method.transform_queries(query, 0) @ k.transpose(-1, -2)

    h, order = hadamard(dim), pairs.flatten()
    q8 = engine(query[..., order] @ h, "q8_0")
    k4 = engine(keys[..., order] @ h, "q4_0")
    rounded = scores("ggml:k=q4_0,v=q8_0")
    torch.testing.assert_close(rounded, q8 @ k4.transpose(-1, -2), rtol=1e-5, atol=1e-5)
    plain = scores("ggml:k=q4_0,v=q8_0,query=float")
    torch.testing.assert_close(plain, query @ (k4 @ h)[..., order.argsort()].transpose(-1, -2),
                               rtol=1e-5, atol=1e-5)
    assert not torch.allclose(rounded, plain, rtol=0, atol=1e-6)
    exact = scores("ggml:k=f16,v=q8_0")  # f16 keys: a float query, no rotation
    torch.testing.assert_close(exact, query @ keys.half().float().transpose(-1, -2))


@pytest.mark.parametrize(("dim", "key_block", "value_block"),
                         [(64, 64, 64), (128, 128, 64), (192, 64, 64), (96, 0, 0), (32, 0, 0)])
def test_rotation_follows_the_engines_head_size_rule(dim, key_block, value_block):
    """llama.cpp rotates a quantized side when the head size is a multiple of 64: keys over the
    largest power of two dividing it, values over 64 (src/llama-kv-cache.cpp)."""
    from kvmix.core.transforms import hadamard
    from kvmix.core.tree import map_tensors
    from kvmix.methods import Blocks, ModelSpec, parse_method

    method = parse_method("ggml:k=q8_0,v=q4_0,key_order=model")
    spec = ModelSpec(1, 1, 1, dim)
    method.bind(spec)
    assert method.rotation == {"k": key_block, "v": value_block}
    values = torch.randn(1, 1, 1, dim, generator=torch.Generator().manual_seed(dim))
    stored = map_tensors(Blocks(*method.encode(values, values, 0, None)), lambda t: t[:, None])
    got = method.decode(stored, 0, None, torch.float32)[1][:, 0]
    if value_block:
        h = torch.block_diag(*[hadamard(value_block)] * (dim // value_block))
        expected = engine(values @ h, "q4_0") @ h
    else:
        expected = engine(values, "q4_0")
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_the_butterfly_is_the_hadamard_matrix_and_ignores_the_batch_around_a_row():
    """ggml and pertoken rotate with additions only: a row's rotation is bit for bit the same
    alone or in any batch (a matmul's rounding depends on its shape: that made a sequence's
    codes, at group 1, depend on the batch it decoded in)."""
    from kvmix.core.transforms import hadamard, walsh_hadamard

    x = torch.randn(5, 3, 128, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(walsh_hadamard(x, 128), x @ hadamard(128) * 128**0.5,
                               rtol=1e-5, atol=1e-4)
    blocks = torch.block_diag(hadamard(64), hadamard(64)) * 8
    torch.testing.assert_close(walsh_hadamard(x, 64), x @ blocks, rtol=1e-5, atol=1e-4)
    assert torch.equal(walsh_hadamard(x, 64)[2:3, 1:2], walsh_hadamard(x[2:3, 1:2], 64))
    with pytest.raises(ValueError, match="power of two dividing 128; got 48"):
        walsh_hadamard(x, 48)


@pytest.mark.parametrize("method", ["ggml-k8v4", "ggml:k=q8_0,v=q8_0"])
def test_a_padded_batch_stores_each_rows_codes_bit_for_bit_as_alone(method):
    """The ggml-k8v4 finding (the unpadded row of a two-row batch left its solo greedy run):
    the rotation's matmul rounded by batch shape and group-1 codes flipped at boundaries. With
    the butterfly every stored page of a row — codes and scales — is its solo run's, bit for
    bit, through a padded prompt and decode steps, in every layer. (What is left is the
    model's own matmuls, which round by batch shape before any cache sees the values: on this
    tiny model vllm-int4 stores one scale one bit apart in a decode step's page.)"""
    from conftest import tiny_llama
    from helpers import method_string, padded_prompts

    import kvmix
    from kvmix.core.tree import tagged_tensors

    model, method = tiny_llama(head_dim=64, num_attention_heads=2), method_string(method)
    g = torch.Generator().manual_seed(6)
    prompts = [torch.randint(1, 97, (n,), generator=g) for n in (41, 23)]
    greedy = {"max_new_tokens": 12, "min_new_tokens": 12, "do_sample": False}
    ids, mask = padded_prompts(prompts)
    with torch.no_grad():
        together = kvmix.make_cache(model, method, backend="torch")
        model.generate(ids, attention_mask=mask, cache=together, **greedy)
        for b, prompt in enumerate(prompts):
            alone = kvmix.make_cache(model, method, backend="torch")
            model.generate(prompt[None], cache=alone, **greedy)
            for mine, solo in zip(together.layers, alone.layers, strict=True):
                pages = [tagged_tensors(layer.rows[row].blocks, "")
                         for layer, row in ((mine, b), (solo, 0))]
                assert len(pages[0]) == len(pages[1]) > 0
                assert all(torch.equal(x, y) for (_, x), (_, y) in zip(*pages, strict=True))


def test_export_refuses_an_unknown_engine_release_before_loading_the_model(capsys):
    from kvmix.cli import main

    with pytest.raises(SystemExit) as stop:
        main(["export", "--plan", "pnmix1", "--engine-version", "vllm=0.28.0", "--out", "x"])
    assert stop.value.code == 2
    assert "vllm release '0.28.0' is unknown; known: 0.33.0" in capsys.readouterr().err
