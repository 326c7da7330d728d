"""Serving engines' KV cache settings, and the nearest one to a kvmix plan.

An engine stores every token's keys and values in one format per side for every layer (vLLM can
leave named layers unquantized): llama.cpp's cache types (``-ctk/-ctv``, quantized values need
flash attention), vLLM's ``--kv-cache-dtype`` (float8 and TurboQuant modes) and SGLang's
(float8, fp4). ``nearest`` picks, per engine, the cheapest setting whose bits per element cover
the plan's, says which kvmix method reproduces it (``simulate``: llama.cpp's types bit for bit
through ``ggml``, the float8 types through ``fp8``; TurboQuant and fp4 are not simulated) and
states plainly what the setting cannot express of the plan — never silently rounded.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from kvmix.methods import Method
from kvmix.methods.ggml import FORMATS, format_bits

ENGINES = ("llama.cpp", "vllm", "sglang")


@dataclass(frozen=True)
class Option:
    """One engine setting: its name, bits per key and value element, the kvmix method string
    that reproduces it (None: kvmix cannot simulate it) and how faithful that is."""

    name: str
    key_bits: float
    value_bits: float
    simulate: str | None
    fidelity: str = ""


FP8 = "kvmix's fp8 method, scales from the prompt (an engine's may come from the checkpoint)"
NOT_SIMULATED = "not simulated by kvmix (bits from the mode's name)"
OPTIONS = {
    "vllm": (Option("auto", 16, 16, "full", "the model's 16-bit cache"),
             Option("fp8_e4m3", 8, 8, "fp8:format=e4m3,scale=tensor", FP8),
             Option("fp8_e5m2", 8, 8, "fp8:format=e5m2,scale=tensor", FP8),
             Option("turboquant_k8v4", 8, 4, None, NOT_SIMULATED),
             Option("turboquant_k3v4_nc", 3, 4, None, NOT_SIMULATED)),
    "sglang": (Option("auto", 16, 16, "full", "the model's 16-bit cache"),
               Option("fp8_e4m3", 8, 8, "fp8:format=e4m3,scale=tensor", FP8),
               Option("fp8_e5m2", 8, 8, "fp8:format=e5m2,scale=tensor", FP8),
               Option("fp4_e2m1", 4, 4, None, NOT_SIMULATED)),
}
GGML_TYPES = sorted(FORMATS, key=format_bits)  # q4_0 (4.5 bits) ... f16


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
    cannot: list[str] = field(default_factory=list)
    skip_layers: list[int] = field(default_factory=list)
    kl: float | None = None


def nearest(method: Method, layers: list[tuple[float, float]]) -> dict[str, Setting]:
    """Per engine, the setting nearest to ``method`` with per-layer (key, value) bits."""
    common = _layout_limits(method) + method.engine_limits()
    layers = [(min(k, 16.0), min(v, 16.0)) for k, v in layers]  # engines' float cache: 16 bits
    return {engine: _nearest(engine, layers, common) for engine in ENGINES}


def engine_flags(simulate: str) -> dict[str, list[str]]:
    """The engines' flags for a kvmix string that reproduces an engine setting (``ggml:…`` or
    ``fp8:…``), by engine; empty when no engine runs it."""
    from kvmix.methods import parse_method

    method = parse_method(simulate)
    if method.name == "ggml":
        return {"llama.cpp": _ggml_flags(method.k, method.v)}
    if method.name == "fp8":
        dtype = f"fp8_{method.format}"
        return {engine: ["--kv-cache-dtype", dtype] for engine in ("vllm", "sglang")}
    return {}


def _nearest(engine: str, layers: list[tuple[float, float]], common: list[str]) -> Setting:
    keys, values = [k for k, _ in layers], [v for _, v in layers]
    cannot = list(common)
    if len(set(layers)) > 1 and engine != "vllm":
        cannot.append("per-layer widths (one cache format for every layer): the setting covers "
                      "the widest layer")
    if engine == "llama.cpp":
        k, v = _ggml_type(max(keys)), _ggml_type(max(values))
        setting = Setting(engine, f"{k}/{v}", _ggml_flags(k, v), format_bits(k), format_bits(v),
                          f"ggml:k={k},v={v}", "bit for bit (llama.cpp's quantizers)", cannot)
    else:  # vLLM covers the median layer and leaves wider layers unquantized; SGLang the widest
        pick = statistics.median if engine == "vllm" else max
        option = _option(engine, pick(keys), pick(values))
        skip = [i for i, (k, v) in enumerate(layers)
                if k > option.key_bits or v > option.value_bits]
        flags = ["--kv-cache-dtype", option.name]
        if skip:
            flags += ["--kv-cache-dtype-skip-layers", ",".join(map(str, skip))]
        setting = Setting(engine, option.name, flags, option.key_bits, option.value_bits,
                          option.simulate, option.fidelity, cannot, skip)
    for side, need, got in (("keys", min(keys), setting.key_bits),
                            ("values", min(values), setting.value_bits)):
        if got > need:
            setting.cannot.append(f"{side} at {need:.3g} bits: the engine's nearest format takes "
                                  f"{got:.3g} (more memory than the plan)")
    return setting


def _option(engine: str, key_bits: float, value_bits: float) -> Option:
    """The cheapest option covering both widths (the 16-bit cache covers everything)."""
    covering = [o for o in OPTIONS[engine] if o.key_bits >= key_bits and o.value_bits >= value_bits]
    return min(covering, key=lambda o: (o.key_bits + o.value_bits, o.name))


def _ggml_type(bits: float) -> str:
    return next((t for t in GGML_TYPES if format_bits(t) >= bits), "f16")


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
