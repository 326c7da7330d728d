"""The contract every method follows, and the model facts a method may check against.

A method turns one block of ``group`` tokens of keys and values into stored state (``encode``),
turns stored blocks back into keys and values (``decode``, on blocks stacked along dimension 1),
declares its theoretical bits per element (``bits``), and may pick channels once
at prefill (``select``). It never sees the cache, the model or transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvmix.core.bits import check_bits
from kvmix.core.quantizers import QuantizedTensor, dequantize_per_token, quantize_per_token

STAT_BITS = 32  # a float16 scale plus a float16 minimum per group
# what a 32-bit model's float sink and residual may be stored in (``residual_dtype``)
SLOT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# What engines cannot express, shared by the methods it applies to (``engine_limits``)
PER_CHANNEL_KEYS = ("per-channel key groups over tokens (engines quantize the channels of one "
                    "token together)")
MIXED_KEYS = "key channels at different widths within a head"
KEY_TRANSFORM = ("a post-RoPE key transform: it needs an online kernel in the engine's attention "
                 "(queries transformed alike)")
VALUE_FOLD = ("the value transform folds into W_V/W_O: serve the model `kvmix export` writes and "
              "it runs in any engine")


@dataclass(frozen=True, eq=False)
class ModelSpec:
    """What a method needs to know about the model it is bound to."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    pairs: torch.Tensor | None = None  # [D/2, 2] RoPE channel pairs read from the model
    kv_norms: torch.Tensor | None = None  # [L, 2] ‖W_K‖²_F, ‖W_V‖²_F per layer
    name: str = ""  # the model's name or path, to refuse artifacts of another model
    folded: str | None = None  # checksum of value transforms folded into W_V/W_O, if any

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.pairs, self.kv_norms) if t is not None]

    def static_nbytes(self) -> int:
        """Pairs as int64 [D/2, 2], norms as float64 [L, 2], when present."""
        pairs = 8 * self.head_dim if self.pairs is not None else 0
        return pairs + (16 * self.n_layers if self.kv_norms is not None else 0)


@dataclass
class Plane:
    """Codes of some channels at one width, for every token of every block (fast paths)."""

    codes: torch.Tensor  # [n, bytes]: per block, codes [H, C, G] (a row per channel)
    bits: int
    index: torch.Tensor  # [H, C] int64: the channel of each code column
    mult: torch.Tensor  # [H, C] float32: the weight of a code (2^shift for a top-bits plane)


@dataclass
class ChannelKeys:
    """Per-channel key groups read by a fast path: x̂ = min + scale·(Σ_planes mult·code + offset)."""

    planes: list[Plane]
    scale: torch.Tensor  # [n, H, D] float16
    minimum: torch.Tensor  # [n, H, D] float16
    offset: torch.Tensor  # [H, D] float32: 0.5 where codes are bin centres, else 0


@dataclass
class TokenGroups:
    """Per-token groups of ``group`` channels read by a fast path: x̂ = min + scale·code, or
    symmetric levels (code − 2^(b−1) + ½)·scale when ``minimum`` is None."""

    codes: torch.Tensor  # [n, bytes]: per block, codes [H, G, D/group, group] (rows of group)
    bits: int
    group: int
    scale: torch.Tensor  # [n, H, G, D/group] float16
    minimum: torch.Tensor | None


@dataclass
class KernelView:
    """A method's stored blocks as the fused decode ops read them, without copying codes:
    keys and values as packed groups, or float blocks [n, H, G, D] (the ``full`` method)."""

    keys: ChannelKeys | TokenGroups | torch.Tensor
    values: TokenGroups | torch.Tensor


@dataclass(frozen=True)
class SelectedChannels:
    """Where a group's high channels come from: its selection's ``bits`` (one bit per head and
    unit, packed [B, H·units/8]; PN-Mix's ``PairMask``), each head's first ``count`` channels,
    selected ones first (``importance.selected_channels``); ``units`` per head, RoPE ``pairs``
    [units, 2] (both channels of a selected pair; None: the units are channels)."""

    units: int
    pairs: torch.Tensor | None
    count: int


@dataclass(frozen=True)
class PageEncoding:
    """How ``encode`` stores a block, for an encoder that writes blocks straight into their
    pages (the CPU op's ``encode_pages``): keys per channel over the block's tokens, each
    group's high channels (its selection's ``channels``; None: no channel is high) at
    ``high_bits`` (min-max) and the others at ``low_bits`` (bin-center where ``center``);
    values per token at ``value_bits`` over ``value_group`` channels. ``key_fields`` name the
    key state's codes, scale, minimum (and the high channels' codes) in that order."""

    low_bits: int
    high_bits: int
    center: bool
    value_bits: int
    value_group: int
    key_fields: tuple[str, ...]
    channels: SelectedChannels | None = None


@dataclass
class Blocks:
    """The quantized blocks of a layer: the method's key and value state, every tensor stacked as
    ``[B, n_blocks, ...]`` so that one ``decode`` call serves the whole history."""

    keys: Any
    values: Any


def positive(value: Any, name: str, minimum: int = 1) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid; expected an integer >= {minimum}")


def require_pairs(spec: ModelSpec, who: str) -> None:
    if spec.head_dim % 2:
        raise ValueError(f"{who} needs an even head dim; the model's is {spec.head_dim}")
    if spec.pairs is None or spec.pairs.numel() != spec.head_dim:
        raise ValueError(f"{who} needs the model's RoPE channel pairs, and this model's RoPE "
                         "layout could not be determined (no rotary embedding found, or it "
                         "does not rotate every channel)")


def choice(value: Any, name: str, valid: tuple[str, ...]) -> None:
    if value not in valid:
        raise ValueError(f"{name}={value!r} is invalid; valid: {', '.join(valid)}")


@dataclass
class Method:
    """Cache layout parameters shared by every method (docs/design/cache-layout.md).

    sink: leading tokens kept at full precision; residual: capacity ``R`` of the full-precision
    tail; group: tokens per quantized block (the key group), which must divide ``residual``;
    residual_dtype: what the sink and residual are stored in when the model runs at 32 bits
    (``float16`` by default, as the papers price them; ``float32`` keeps the model's floats). A
    16-bit model's are its own dtype, and ``full`` always keeps the model's dtype.
    """

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    presets: ClassVar[dict[str, dict[str, Any]]] = {}
    quantizes: ClassVar[bool] = True
    # What the fused decode ops cover, for ``kvmix methods`` (``kernel_view`` says per instance).
    fast_path: ClassVar[str] = "reference only"

    sink: int = 32
    residual: int = 128
    group: int = 128
    residual_dtype: str = "float16"

    def __post_init__(self) -> None:
        positive(self.sink, "sink", minimum=0)
        choice(self.residual_dtype, "residual_dtype", tuple(SLOT_DTYPES))
        positive(self.residual, "residual")
        positive(self.group, "group")
        if self.residual % self.group:
            divisors = [g for g in range(1, self.residual + 1) if self.residual % g == 0]
            raise ValueError(f"group={self.group} must divide residual={self.residual} "
                             f"(valid groups: {divisors})")

    def bind(self, spec: ModelSpec) -> None:
        """Check the parameters against a model; raise ValueError naming the parameter."""

    def slot_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype of the float sink and residual of a model running in ``dtype``: 16-bit
        models and methods that do not quantize keep ``dtype``."""
        if not self.quantizes or dtype.itemsize <= 2:
            return dtype
        return SLOT_DTYPES[self.residual_dtype]

    def select(self, queries: torch.Tensor, keys: torch.Tensor, layer: int,
               values: torch.Tensor | None = None) -> Any:
        """Prefill-time selection (channels, scales); queries: [B, Hq, T, D], keys and values:
        [B, Hkv, T, D]."""
        return None

    def query_sums(self, queries: torch.Tensor) -> torch.Tensor | None:
        """What ``select`` reads of queries [B, Hq, T, D], summed over the tokens ([B, Hkv, C]
        float32), or None where it reads no query. Sums of chunks add up, so ``select_from`` can
        select from queries that arrived over several steps (the vLLM plugin's first group)."""
        return None

    def select_from(self, query_sums: torch.Tensor | None, tokens: torch.Tensor,
                    keys: torch.Tensor, layer: int, values: torch.Tensor | None = None) -> Any:
        """``select`` from ``query_sums`` over ``tokens`` [B] tokens and those tokens' keys and
        values [B, Hkv, T, D]: what ``select`` gives for the queries the sums came from."""
        if type(self).select is Method.select:
            return None
        raise NotImplementedError(f"{self.name} selects from the prompt's queries only")

    def transform_keys(self, keys: torch.Tensor, layer: int) -> torch.Tensor:
        """Applied to new keys [B, H, q, D] as they enter the cache (after RoPE). A method (or a
        setting) that leaves keys as they are returns ``keys`` itself: the vLLM plugin then
        skips the call."""
        return keys

    def transform_queries(self, queries: torch.Tensor, layer: int) -> torch.Tensor:
        """Applied to queries [B, Hq, q, D] in the attention hook, so that q'·k' = q·k; like
        ``transform_keys``, ``queries`` itself where it changes nothing."""
        return queries

    def value_fold(self, spec: ModelSpec) -> tuple[torch.Tensor, str] | None:
        """A value transform T_v [L, H, D, D] to fold into W_V/W_O of a model copy (and the id
        that marks the copy), or None. kvmix.prepare_model applies it."""
        return None

    def observe(self, selection: Any, queries: torch.Tensor, keys: torch.Tensor,
                layer: int) -> Any:
        """After each later attention call: the new tokens' queries and keys ([B, H, q, D])."""
        return selection

    def follows_decoding(self) -> bool:
        """Whether ``observe`` changes the selection (online selection); only then does a
        decode step call it for every sequence."""
        return False

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[Any, Any]:
        """keys, values: [B, Hkv, group, D] -> stored state (real tokens only: the cache keeps
        padding out of every method)."""
        raise NotImplementedError

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Stacked state -> keys, values: [B, n_blocks, Hkv, group, D] in ``dtype``."""
        raise NotImplementedError

    def token_values(self, values: torch.Tensor, layer: int) -> QuantizedTensor | None:
        """values [B, Hkv, T, D] -> what ``encode`` stores of them (its ``Blocks.values``), for a
        method whose values are per-token groups: each token's codes then depend on that token
        alone, so a block's values can be written token by token. None for other methods."""
        return None

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        """Theoretical stored bits per key element and per value element of a block."""
        raise NotImplementedError

    def unfused(self) -> str:
        """Why this instance's blocks have no fused decode path ("" when the fused kernels read
        them through ``kernel_view``)."""
        return f"{self.name} has no fused decode path in kvmix" \
            if self.fast_path.startswith("reference only") else ""

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView | None:
        """One sequence's blocks (tensors [1, n, ...]) as the fused decode ops read them, or
        None where this configuration has no fast path (the reference path serves it)."""
        return None

    def page_encoding(self, layer: int) -> PageEncoding | None:
        """How ``encode`` stores a block of ``layer`` where an encoder can write it straight
        into its page, or None where only ``encode`` can (the default)."""
        return None

    def selection_bits(self, spec: ModelSpec) -> int:
        """Bits per batch element and layer that ``select`` keeps for the whole generation."""
        return 0

    def static_tensors(self) -> list[torch.Tensor]:
        """Per-model tensors the method keeps once for every layer and sequence (rotations,
        transforms); a cache counts them under ``static``."""
        return []

    def static_nbytes(self, spec: ModelSpec) -> int:
        """What ``static_tensors`` should take, from their shapes."""
        return 0

    def engine_limits(self) -> list[str]:
        """What no serving engine's cache format expresses in this configuration (engines store
        each token's channels in blocks, one width per layer), in words, for ``kvmix export
        --plan``; the layout's float sink and residual are checked there."""
        return []

    @classmethod
    def describe(cls) -> str:
        """The bit formula, in words, for ``kvmix methods``."""
        return ""


@dataclass
class PerTokenValues(Method):
    """A key method whose values are KIVI-style: per token, ``value_bits`` over groups of
    ``value_group`` channels. Key methods share this value configuration so that comparisons
    between them differ in the keys only."""

    value_bits: int = 2
    value_group: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        check_bits(self.value_bits, "value_bits")
        positive(self.value_group, "value_group")

    def bind(self, spec: ModelSpec) -> None:
        if spec.head_dim % self.value_group:
            raise ValueError(f"value_group={self.value_group} must divide the head dim "
                             f"{spec.head_dim}")
        self.spec = spec

    def encode_values(self, values: torch.Tensor) -> QuantizedTensor:
        return quantize_per_token(values, self.value_bits, self.value_group)  # [B, H, G, D]

    def token_values(self, values: torch.Tensor, layer: int) -> QuantizedTensor:
        return self.encode_values(values)

    def decode_values(self, blocks: Blocks, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_per_token(blocks.values, dtype)  # [B, n, H, G, D]

    def values_view(self, blocks: Blocks) -> TokenGroups:
        return token_groups(blocks.values, self.value_group)

    def value_bits_per_element(self) -> float:
        return self.value_bits + STAT_BITS / self.value_group


def select_by_sums(method: Method, queries: torch.Tensor, keys: torch.Tensor, layer: int,
                   values: torch.Tensor | None) -> Any:
    """``select`` of a method that selects through ``query_sums`` and ``select_from``."""
    tokens = torch.full((keys.shape[0],), float(queries.shape[-2]), device=keys.device)
    return method.select_from(method.query_sums(queries), tokens, keys, layer, values)


def token_groups(stored: QuantizedTensor, group: int, symmetric: bool = False) -> TokenGroups:
    """One sequence's per-token groups (QuantizedTensor or QuEST's SymmetricTensor, rows
    [1, n]) as a fast path reads them: views, no copies."""
    scale = stored.step if symmetric else stored.scale  # [1, n, H, G, D/group, 1]
    minimum = None if symmetric else stored.minimum[0].squeeze(-1)
    return TokenGroups(stored.codes[0], stored.bits, group, scale[0].squeeze(-1), minimum)


def channel_keys(stored: QuantizedTensor) -> ChannelKeys:
    """One sequence's per-channel keys of one width (rows [1, n], codes [H, D, G] per block)
    as a fast path reads them."""
    scale = stored.scale[0].squeeze(-1)  # [n, H, D]
    heads, dim = scale.shape[1:]
    index, ones, zeros = every_channel(heads, dim, scale.device)
    plane = Plane(stored.codes[0], stored.bits, index, ones)
    return ChannelKeys([plane], scale, stored.minimum[0].squeeze(-1), zeros)


@functools.cache
def every_channel(heads: int, dim: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Shared constants: channel indices [H, D] int64, ones and zeros [H, D] float32."""
    index = torch.arange(dim, device=device).expand(heads, dim).contiguous()
    return index, torch.ones(heads, dim, device=device), torch.zeros(heads, dim, device=device)
