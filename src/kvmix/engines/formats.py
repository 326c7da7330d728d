"""The serving engines' KV cache formats, one table per engine release: every value its cache
flag accepts, what that value stores (bits, grouping, scale placement), the kvmix method that
reproduces it (``simulate``; None: not simulated, bits from the source) and where it was read.

Bits per element are the codes plus their scales: a scale per block of channels adds
``scale bits / block``; a scale (or norm) per token and KV head adds ``bits / head_dim``, so
``Format.bits`` takes the head dim. Formats that only serve some hardware or architectures
(``only``) are listed with that condition and not proposed by ``kvmix export --plan``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmix.methods.ggml import FORMATS as GGML_FORMATS
from kvmix.methods.ggml import format_bits as ggml_bits

FP8 = "fp8:format={},scale=tensor"
FLOAT_CACHE = "the model's 16-bit cache"
PER_TENSOR = "float8 codes, one float32 scale per layer (from the checkpoint, else 1.0)"


@dataclass(frozen=True)
class Format:
    """One value of an engine's cache flag. ``key``/``value``: (bits per element, bits per
    token and KV head)."""

    name: str
    key: tuple[float, float]
    value: tuple[float, float]
    stores: str
    simulate: str | None = None
    only: str = ""  # the hardware or architecture it is limited to; "" = any model

    def bits(self, head_dim: int) -> tuple[float, float]:
        return tuple(bits + per_head / head_dim for bits, per_head in (self.key, self.value))

    @property
    def measured(self) -> str:
        return (f"measured: kvmix simulates it ({self.simulate})" if self.simulate
                else "from the source: kvmix does not simulate it")


@dataclass(frozen=True)
class Release:
    engine: str
    version: str
    flag: str  # how the format is chosen
    source: str  # where the accepted values and formats were read
    formats: tuple[Format, ...]

    @property
    def accepted(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.formats)

    def format(self, name: str) -> Format:
        return next(f for f in self.formats if f.name == name)


def _same(name: str, bits: float, per_head: float, stores: str, simulate: str | None = None,
          only: str = "") -> Format:
    return Format(name, (bits, per_head), (bits, per_head), stores, simulate, only)


def _ggml(name: str, stores: str, simulate: bool = True) -> Format:
    bits = ggml_bits(name) if name in GGML_FORMATS else 4.5  # iq4_nl: 4 bits + float16 / 32
    return _same(name, bits, 0, stores, f"ggml:k={name},v={name}" if simulate else None)


LLAMA_CPP = Release(
    "llama.cpp", "0.3.36", "-ctk/-ctv (a quantized V needs -fa on)",
    "llama.cpp as vendored by llama-cpp-python 0.3.36: common/arg.cpp (kv_cache_types), "
    "ggml/src/ggml-common.h (blocks), src/llama-kv-cache.cpp (rotation), "
    "ggml/src/ggml-cpu/ops.cpp (query rounding)",
    (_same("f32", 32, 0, "float32", "full"),
     _ggml("f16", "float16"),
     _ggml("bf16", "bfloat16"),
     _ggml("q8_0", "8-bit codes, float16 scale per 32 channels"),
     _ggml("q4_0", "4-bit codes, float16 scale per 32 channels"),
     _ggml("q4_1", "4-bit codes, float16 scale and minimum per 32 channels"),
     _ggml("iq4_nl", "4-bit indices into a non-linear table, float16 scale per 32 channels "
                     "(its scale search is not reproduced)", simulate=False),
     _ggml("q5_0", "5-bit codes, float16 scale per 32 channels"),
     _ggml("q5_1", "5-bit codes, float16 scale and minimum per 32 channels")))

_TURBO = ("Hadamard-rotated Lloyd-Max codes; first and last 2 layers left unquantized "
          "(boundary protection)")
VLLM = Release(
    "vllm", "0.33.0", "--kv-cache-dtype (--kv-cache-dtype-skip-layers: indices or attention "
    "types left unquantized)",
    "vllm 0.33.0: vllm/config/cache.py (CacheDType), vllm/v1/kv_cache_interface.py, "
    "v1/attention/ops/triton_reshape_and_cache_flash.py, int4_per_token_head.py, "
    "model_executor/layers/quantization/turboquant/config.py, v1/attention/ops/rocm_octave.py, "
    "v1/attention/ops/ultraquant/format.py",
    (_same("auto", 16, 0, FLOAT_CACHE, "full"),
     _same("float16", 16, 0, "float16 (must match the model's dtype)", "full",
           "float16 models"),
     _same("bfloat16", 16, 0, "bfloat16 (must match the model's dtype)", "full",
           "bfloat16 models"),
     _same("fp8_e4m3", 8, 0, PER_TENSOR, FP8.format("e4m3")),
     _same("fp8", 8, 0, PER_TENSOR + " (= fp8_e4m3 on CUDA)", FP8.format("e4m3")),
     _same("fp8_e5m2", 8, 0, PER_TENSOR, FP8.format("e5m2")),
     _same("fp8_inc", 8, 0, PER_TENSOR, only="Intel Gaudi"),
     _same("fp8_ds_mla", 8, 0, "656 bytes per token (MLA latent)", only="MLA models"),
     _same("nvfp4_ds_mla", 4.5, 0, "FP4 MLA latent (FlashMLA sparse)", only="MLA models"),
     Format("turboquant_k8v4", (8, 0), (4, 32), "keys float8; values 4-bit with a float16 "
            "scale and zero per token and head; " + _TURBO),
     Format("turboquant_4bit_nc", (4, 16), (4, 32), "keys 4-bit Lloyd-Max with a float16 norm "
            "per token and head, values 4-bit (float16 scale and zero); " + _TURBO),
     Format("turboquant_k3v4_nc", (3, 16), (4, 32), "keys 3-bit Lloyd-Max + float16 norm, "
            "values 4-bit (float16 scale and zero); " + _TURBO),
     Format("turboquant_3bit_nc", (3, 16), (3, 32), "keys 3-bit Lloyd-Max + float16 norm, "
            "values 3-bit (float16 scale and zero); " + _TURBO),
     Format("octave_k3v4", (4.25, 0), (4, 16), "keys: RoPE dims 4-bit, others 3-bit, float16 "
            "scale per 64 dims (all 4-bit on a fully rotary head); values 4-bit, one float16 "
            "scale", only="ROCm"),
     Format("octave_k3v3", (4.25, 0), (3, 16), "keys as octave_k3v4; values 3-bit, one "
            "float16 scale", only="ROCm"),
     _same("octave_k3v3_compact", 3, 16, "3-bit codes after one Hadamard over the head, one "
           "float16 scale per token and head", only="ROCm"),
     _same("ultraquant_4bit", 4.25, 0, "FP4 E2M1, UE8M0 scale per 32 channels (keys "
           "Hadamard-rotated)", only="ROCm (CDNA4)"),
     _same("int4_per_token_head", 4, 32, "randomized-Hadamard-rotated asymmetric 4-bit codes, "
           "float32 scale per token and head (zero point in its low mantissa bits)",
           "pertoken:format=int4_per_token_head"),
     _same("int8_per_token_head", 8, 32, "int8 codes, float32 scale per token and head",
           "pertoken:format=int8_per_token_head"),
     _same("fp8_per_token_head", 8, 32, "e4m3 codes, float32 scale per token and head",
           "pertoken:format=fp8_per_token_head"),
     _same("nvfp4", 4.5, 0, "FP4 E2M1, float8 e4m3 scale per 16 channels", only="Blackwell"),
     _same("nvfp4_4over6", 4.5, 0, "as nvfp4, each block's scale max/6 or max/4 by error",
           only="Blackwell")))

_SGLANG_FORMATS = (
    _same("auto", 16, 0, FLOAT_CACHE, "full"),
    _same("fp8_e4m3", 8, 0, PER_TENSOR, FP8.format("e4m3")),  # of equal bits, the first wins
    _same("fp8_e5m2", 8, 0, PER_TENSOR, FP8.format("e5m2")),
    _same("mxfp8", 8.25, 0, "e4m3 codes, UE8M0 scale per 32 channels", "pertoken:format=mxfp8",
          "the FA4 backend"),
    _same("bf16", 16, 0, "bfloat16", "full", "bfloat16 models"),
    _same("bfloat16", 16, 0, "bfloat16", "full", "bfloat16 models"),
    _same("nvfp4", 4.5, 0, "FP4 E2M1, float8 e4m3 scale per 16 channels",
          only="CUDA 12.8+ (Blackwell)"),
    _same("fp4_mx_block16", 4.5, 0, "FP4 E2M1, one exponent byte per 16 channels",
          only="CUDA 12.8+"))
_SGLANG_SOURCE = ("sglang {}: sglang/srt/arg_groups/fields/model.py (choices), "
                  "srt/mem_cache/memory_pool.py, kernels/ops/kvcache/mxfp8_quant_store_kv.py, "
                  "srt/layers/quantization/kvfp4_tensor.py")
SGLANG = Release("sglang", "0.5.23", "--kv-cache-dtype", _SGLANG_SOURCE.format("0.5.23"),
                 _SGLANG_FORMATS)
SGLANG_0_5_20 = Release(
    "sglang", "0.5.20", "--kv-cache-dtype", _SGLANG_SOURCE.format("0.5.20"),
    (*_SGLANG_FORMATS, _same("fp4_e2m1", 4.5, 0, "deprecated alias of fp4_mx_block16 (removed "
                             "in 0.5.21)", only="CUDA 12.8+")))

RELEASES: dict[str, dict[str, Release]] = {
    "llama.cpp": {LLAMA_CPP.version: LLAMA_CPP},
    "vllm": {VLLM.version: VLLM},
    "sglang": {SGLANG.version: SGLANG, SGLANG_0_5_20.version: SGLANG_0_5_20},
}
CURRENT = {"llama.cpp": LLAMA_CPP.version, "vllm": VLLM.version, "sglang": SGLANG.version}
ENGINES = tuple(RELEASES)


def releases(versions: dict[str, str] | None = None) -> dict[str, Release]:
    """Each engine's release: the current one unless ``versions`` names another known one."""
    versions = {**CURRENT, **(versions or {})}
    unknown = set(versions) - set(RELEASES)
    if unknown:
        raise ValueError(f"engine {sorted(unknown)[0]!r} is unknown; known: "
                         f"{', '.join(ENGINES)}")
    for engine, version in versions.items():
        if version not in RELEASES[engine]:
            raise ValueError(f"{engine} release {version!r} is unknown; known: "
                             f"{', '.join(RELEASES[engine])}")
    return {engine: RELEASES[engine][version] for engine, version in versions.items()}


def parse_versions(text: str) -> dict[str, str]:
    """``engine=version[,engine=version]`` (``--engine-version``) -> {engine: version}."""
    pairs = [item.partition("=") for item in text.split(",") if item.strip()]
    if any(not sep or not v for _, sep, v in pairs):
        raise ValueError(f"engine_version={text!r} is invalid; expected engine=version, e.g. "
                         "sglang=0.5.20")
    versions = {engine.strip(): version.strip() for engine, _, version in pairs}
    releases(versions)  # unknown engines or releases fail here, listing the known ones
    return versions
