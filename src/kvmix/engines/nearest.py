"""The nearest setting of each serving engine to a kvmix plan.

An engine stores every token's keys and values in one format per side for every layer (vLLM can
leave named layers unquantized): llama.cpp's cache types (``-ctk/-ctv``, quantized values need
flash attention), vLLM's and SGLang's ``--kv-cache-dtype``. The formats of each release — the
values its flag accepts, their bits and whether kvmix simulates them — are the tables of
``kvmix.engines.formats``. ``nearest`` picks, per engine, the cheapest format of the
targeted release whose bits per element cover the plan's, says which kvmix method reproduces it
(or that its bits come from the source) and states plainly what the setting cannot express of
the plan — never silently rounded.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvmix.engines.formats import Format, Release, releases
from kvmix.methods import Method


@dataclass
class Setting:
    """The nearest setting of one engine to a plan."""

    engine: str
    setting: str
    flags: list[str]
    key_bits: float
    value_bits: float
    simulate: str | None
    fidelity: str
    release: str = ""
    cannot: list[str] = field(default_factory=list)
    skip_layers: list[int] = field(default_factory=list)
    kl: float | None = None


def nearest(method: Method, layers: list[tuple[float, float]], head_dim: int,
            versions: dict[str, str] | None = None) -> dict[str, Setting]:
    """Per engine, the setting of its release (the current one unless ``versions`` names
    another) nearest to ``method`` with per-layer (key, value) bits and this head dim."""
    common = _layout_limits(method) + method.engine_limits()
    layers = [(min(k, 16.0), min(v, 16.0)) for k, v in layers]  # engines' float cache: 16 bits
    return {engine: _nearest(release, layers, head_dim, common)
            for engine, release in releases(versions).items()}


def engine_flags(simulate: str, versions: dict[str, str] | None = None) -> dict[str, list[str]]:
    """The flags, by engine, of the formats a kvmix string reproduces (``ggml:…``, ``fp8:…``,
    ``pertoken:…``); empty when no engine stores that format."""
    from kvmix.methods import parse_method

    method = parse_method(simulate)
    if method.name == "ggml":
        return {"llama.cpp": _ggml_flags(method.k, method.v)}
    text = repr(method)
    flags = {}
    for engine, release in releases(versions).items():
        match = next((f for f in release.formats if f.simulate and not f.only
                      and repr(parse_method(f.simulate)) == text), None)
        if match and engine != "llama.cpp":
            flags[engine] = ["--kv-cache-dtype", match.name]
    return flags


def _nearest(release: Release, layers: list[tuple[float, float]], head_dim: int,
             common: list[str]) -> Setting:
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    cannot = list(common)
    engine = release.engine
    if len(set(layers)) > 1 and engine != "vllm":
        cannot.append("per-layer widths (one cache format for every layer): the setting covers "
                      "the widest layer")
    if engine == "llama.cpp":
        k, v = (_covering(release, head_dim, bits, side)
                for side, bits in ((0, max(keys)), (1, max(values))))
        key_bits, value_bits = k.bits(head_dim)[0], v.bits(head_dim)[1]
        setting = Setting(engine, f"{k.name}/{v.name}", _ggml_flags(k.name, v.name), key_bits,
                          value_bits, f"ggml:k={k.name},v={v.name}",
                          "measured: kvmix simulates it bit for bit (llama.cpp's quantizers)",
                          release.version, cannot)
    else:  # vLLM covers the median layer and leaves wider layers unquantized; SGLang the widest
        pick = statistics.median if engine == "vllm" else max
        option = _option(release, head_dim, pick(keys), pick(values))
        key_bits, value_bits = option.bits(head_dim)
        skip = [i for i, (k, v) in enumerate(layers) if k > key_bits or v > value_bits]
        flags = ["--kv-cache-dtype", option.name]
        if skip:
            flags += ["--kv-cache-dtype-skip-layers", ",".join(map(str, skip))]
        setting = Setting(engine, option.name, flags, key_bits, value_bits, option.simulate,
                          option.measured, release.version, cannot, skip)
    for side, need, got in (("keys", min(keys), setting.key_bits),
                            ("values", min(values), setting.value_bits)):
        if got > need:
            setting.cannot.append(f"{side} at {need:.3g} bits: the engine's nearest format takes "
                                  f"{got:.3g} (more memory than the plan)")
    return setting


def _candidates(release: Release) -> list[Format]:
    """The formats any model gets (not limited to some hardware or architecture)."""
    return [f for f in release.formats if not f.only]


def _option(release: Release, head_dim: int, key_bits: float, value_bits: float) -> Format:
    """The cheapest format covering both widths (the 16-bit cache covers everything); of equal
    bits, the first in the release's table (``fp8_e4m3`` before its alias ``fp8``)."""
    covering = [f for f in _candidates(release)
                if f.bits(head_dim)[0] >= key_bits and f.bits(head_dim)[1] >= value_bits]
    return min(covering, key=lambda f: sum(f.bits(head_dim)))


def _covering(release: Release, head_dim: int, bits: float, side: int) -> Format:
    """llama.cpp: the cheapest simulated type covering one side's width (f16 covers all)."""
    simulated = [f for f in _candidates(release) if f.simulate and f.name != "f32"]
    covering = [f for f in simulated if f.bits(head_dim)[side] >= bits]
    return min(covering, key=lambda f: f.bits(head_dim)[side])


def _ggml_flags(k: str, v: str) -> list[str]:
    return ["-ctk", k, "-ctv", v, "-fa", "on"]


def _layout_limits(method: Method) -> list[str]:
    floats = []
    if method.sink:
        floats.append(f"a float sink of {method.sink} tokens")
    if method.residual > 1:
        floats.append(f"a float residual of up to {method.residual} recent tokens")
    if not floats:
        return []
    return [" and ".join(floats) + " (engines store every token in the cache format)"]
