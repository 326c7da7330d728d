"""``pnmix``: PN-Mix, pair-norm guided mixed-precision keys (docs/guide/methods.md).

Quantizing a key pair perturbs the logit ``q·k = Σ_p ‖q_p‖‖k_p‖ cos φ_p`` in proportion to
``‖q_p‖·‖k_p‖``, so at prefill, once, PN-Mix scores every RoPE pair of every (sequence, layer,
KV head) by ``mean over the group's query heads of E_t‖q_p‖ · E_t‖k_p‖`` (padding excluded) and
keeps the top ``ratio`` of pairs as a bit mask of B·L·H_kv·D/2 bits for the whole generation.

Keys, per channel over groups of ``group`` tokens: both channels of a selected pair at
``high_bits`` (min-max), the rest at ``low_bits`` (bin-center when ``one_bit_correction`` and
``low_bits`` is 1). Stored as uniform planes: a ``low_bits`` plane for every channel (for a high
channel, the top bits of its code, which for 3/1 bits *is* its 1-bit code) plus a
``high_bits - low_bits`` plane for the high channels only, and one float16 scale and minimum per
channel. Values: per token at ``value_bits`` over ``value_group`` channels.

Key bits per element: ``low_bits + (high channels / D)·(high_bits - low_bits) + 32/group``
(3/1 bits: ``ratio·3 + (1-ratio)·1 + 32/group``), plus the mask, D/2 bits per head and layer.

Parameters: ``criterion`` — ``qk_pair_norm`` (the paper's), ``key_pair_norm``, or the
channel criteria ``key_range`` and ``key_magnitude`` (same number of high channels);
``selection`` — ``prefill`` (the paper's) or ``online``: re-select for every block from query and
key pair-norm sums accumulated while decoding, storing each block's high-channel indices.
Presets: ``pnmix1`` (ratio 0.5, group 128, ≈2.26 key bits), ``pnmix2`` (ratio 0.4, group 64).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvmix.core.bits import check_bits
from kvmix.core.importance import (
    CRITERIA,
    PAIR_CRITERIA,
    channel_mask,
    group_mean,
    key_scores,
    mask_index,
    pair_norms,
    pair_to_channels,
    query_pair_sums,
    selected_channels,
    top_mask,
)
from kvmix.core.packing import pack, unpack
from kvmix.core.quantizers import quantize_mixed, reconstruct
from kvmix.methods.base import (
    MIXED_KEYS,
    PER_CHANNEL_KEYS,
    STAT_BITS,
    Blocks,
    ChannelKeys,
    KernelView,
    ModelSpec,
    PageEncoding,
    PerTokenValues,
    Plane,
    SelectedChannels,
    choice,
    every_channel,
    require_pairs,
    select_by_sums,
)
from kvmix.methods.registry import register

SELECTIONS = ("prefill", "online")
INDEX_BITS = 8  # one uint8 channel index per high channel (online selection)


@dataclass
class MixedKeys:
    """One block of PN-Mix keys (rows: [B] or [B, n_blocks])."""

    low: torch.Tensor = field(metadata={"kind": "codes"})  # low_bits plane [H, D, G], all channels
    high: torch.Tensor = field(metadata={"kind": "codes"})  # refinement plane [H, k, G]
    scale: torch.Tensor = field(metadata={"kind": "scales"})  # [*rows, H, 1, D] float16
    minimum: torch.Tensor = field(metadata={"kind": "zeros"})  # [*rows, H, 1, D] float16
    # online selection only: each block's high channels, [*rows, H, k] uint8
    index: torch.Tensor | None = field(default=None, metadata={"kind": "masks"})


@dataclass
class PairMask:
    """The prefill selection: one bit per (KV head, pair or channel), packed: [B, bytes]."""

    bits: torch.Tensor = field(metadata={"kind": "masks"})
    units: int  # pairs (pair criteria) or channels (channel criteria) per head


@dataclass
class RunningNorms:
    """Online selection: query and key pair-norm sums so far, [B, Hkv, P] float32, and counts."""

    query_sum: torch.Tensor = field(metadata={"kind": "masks"})
    key_sum: torch.Tensor = field(metadata={"kind": "masks"})
    query_count: torch.Tensor = field(metadata={"kind": "masks"})  # [B]
    key_count: torch.Tensor = field(metadata={"kind": "masks"})  # [B]


@register
@dataclass
class PNMix(PerTokenValues):
    """PN-Mix: pair-norm guided 3/1-bit keys chosen at prefill; per-token values."""

    name: ClassVar[str] = "pnmix"
    summary: ClassVar[str] = "PN-Mix: 3/1-bit keys per RoPE pair by q·k pair-norm importance"
    fast_path: ClassVar[str] = "cpu op + triton (two planes; selection=online: reference)"
    presets: ClassVar[dict] = {"pnmix1": {"ratio": 0.5, "group": 128},
                               "pnmix2": {"ratio": 0.4, "group": 64}}

    ratio: float = 0.5
    group: int = 128
    high_bits: int = 3
    low_bits: int = 1
    one_bit_correction: bool = True
    sink: int = 32
    residual: int = 128
    criterion: str = "qk_pair_norm"
    selection: str = "prefill"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.ratio, (int, float)) or not 0 <= self.ratio <= 1:
            raise ValueError(f"ratio={self.ratio!r} is invalid; expected a number in [0, 1]")
        check_bits(self.high_bits, "high_bits", (2, 3, 4, 8))
        check_bits(self.low_bits, "low_bits", (1, 2, 3, 4))
        if self.high_bits <= self.low_bits:
            raise ValueError(f"high_bits={self.high_bits} must be greater than "
                             f"low_bits={self.low_bits}")
        check_bits(self.high_bits - self.low_bits, "high_bits - low_bits")
        choice(self.criterion, "criterion", CRITERIA)
        choice(self.selection, "selection", SELECTIONS)
        if self.selection == "online" and self.criterion not in PAIR_CRITERIA:
            raise ValueError(f"selection='online' needs a pair criterion; criterion="
                             f"{self.criterion!r} is not one of {list(PAIR_CRITERIA)}")

    # -- binding and bits -------------------------------------------------------------------

    def bind(self, spec: ModelSpec) -> None:
        if self.criterion in PAIR_CRITERIA:
            require_pairs(spec, f"{self.name} with criterion={self.criterion!r}")
        super().bind(spec)

    @property
    def center(self) -> bool:
        return self.one_bit_correction and self.low_bits == 1

    def high_channels(self, head_dim: int) -> int:
        """Channels kept at high_bits per head: both channels of round(ratio·D/2) pairs."""
        return 2 * round(self.ratio * head_dim / 2)

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        dim = self.spec.head_dim
        high = self.high_channels(dim)
        key = self.low_bits + high / dim * (self.high_bits - self.low_bits) + STAT_BITS / self.group
        if self.selection == "online":
            key += high * INDEX_BITS / (dim * self.group)
        return key, self.value_bits_per_element()

    def engine_limits(self) -> list[str]:
        return [PER_CHANNEL_KEYS, MIXED_KEYS]

    def selection_bits(self, spec: ModelSpec) -> int:
        if self.selection == "online":  # two float32 sums per (head, pair) and two counts
            return 2 * 32 * spec.n_kv_heads * spec.head_dim // 2 + 2 * 32
        units = spec.head_dim // 2 if self.criterion in PAIR_CRITERIA else spec.head_dim
        return spec.n_kv_heads * units

    @classmethod
    def describe(cls) -> str:
        return ("key bits = low_bits + high share·(high_bits - low_bits) + 32/group "
                "(3/1: ratio·3 + (1-ratio)·1 + 32/group) + D/2 mask bits per head; "
                "value bits = value_bits + 32/value_group")

    # -- selection ---------------------------------------------------------------------------

    def select(self, queries: torch.Tensor, keys: torch.Tensor, layer: int,
               values: torch.Tensor | None = None) -> PairMask | RunningNorms:
        if self.selection == "online":
            return self.observe(None, queries, keys, layer)
        return select_by_sums(self, queries, keys, layer, values)

    def query_sums(self, queries: torch.Tensor) -> torch.Tensor | None:
        if self.criterion != "qk_pair_norm":
            return None
        return query_pair_sums(queries, self.spec.pairs, self.spec.n_kv_heads)  # [B, H, P]

    def select_from(self, query_sums: torch.Tensor | None, tokens: torch.Tensor,
                    keys: torch.Tensor, layer: int, values: torch.Tensor | None = None
                    ) -> PairMask:
        if self.selection == "online":
            raise NotImplementedError("selection='online' follows every query (observe)")
        query_mean = None if query_sums is None else query_sums / tokens[:, None, None]
        score = key_scores(self.criterion, query_mean, keys, None, self.spec.pairs)
        units = score.shape[-1]
        count = self.high_channels(self.spec.head_dim)
        chosen = top_mask(score, count // 2 if units < self.spec.head_dim else count)
        return PairMask(pack(chosen, 1), units)

    def follows_decoding(self) -> bool:
        return self.selection == "online"

    def observe(self, selection: Any, queries: torch.Tensor, keys: torch.Tensor,
                layer: int) -> Any:
        if self.selection != "online":
            return selection
        pairs, heads = self.spec.pairs, keys.shape[1]
        q_count, k_count = _count(queries), _count(keys)
        q = group_mean(pair_norms(queries.float(), pairs).mean(-2), heads)
        k = pair_norms(keys.float(), pairs).mean(-2)
        update = RunningNorms(q * q_count[:, None, None], k * k_count[:, None, None],
                              q_count, k_count)
        if selection is None:
            return update
        return RunningNorms(*(getattr(selection, f) + getattr(update, f)
                              for f in ("query_sum", "key_sum", "query_count", "key_count")))

    def high_index(self, selection: PairMask | RunningNorms) -> torch.Tensor:
        """[B, H, k] sorted channel indices kept at high_bits."""
        heads, dim = self.spec.n_kv_heads, self.spec.head_dim
        if isinstance(selection, RunningNorms):
            score = selection.key_sum / selection.key_count.clamp_min(1)[:, None, None]
            if self.criterion == "qk_pair_norm":
                queries = selection.query_sum / selection.query_count.clamp_min(1)[:, None, None]
                score = score * queries
            chosen = top_mask(score, self.high_channels(dim) // 2)
            chosen = pair_to_channels(chosen, self.spec.pairs)
            return mask_index(chosen.bool(), self.high_channels(dim))  # [B, H, k]
        pairs = self.spec.pairs if selection.units < dim else None
        return selected_channels(selection.bits, heads, selection.units, pairs,
                                 self.high_channels(dim))

    # -- storage -----------------------------------------------------------------------------

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[MixedKeys, Any]:
        # keys, values: [B, H, G, D]
        index = self.high_index(selection)  # [B, H, k]
        low, high, scale, minimum = quantize_mixed(keys, index, self.high_bits, self.low_bits,
                                                   self.center)
        stored = MixedKeys(low, high, scale, minimum,
                           index.to(torch.uint8) if self.selection == "online" else None)
        return stored, self.encode_values(values)

    def page_encoding(self, layer: int) -> PageEncoding | None:
        if self.selection == "online":  # each block's indices stored: encode alone
            return None
        dim = self.spec.head_dim
        units = dim // 2 if self.criterion in PAIR_CRITERIA else dim
        return PageEncoding(self.low_bits, self.high_bits, self.center, self.value_bits,
                            self.value_group, ("low", "scale", "minimum", "high"),
                            SelectedChannels(units, self.spec.pairs if units < dim else None,
                                             self.high_channels(dim)))

    def unfused(self) -> str:
        return "pnmix:selection=online picks each block's channels (the reference path)" \
            if self.selection == "online" else ""

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView | None:
        """Two planes: the low plane of every channel (for a high channel, its top bits, worth
        2^shift) and the refinement plane of the high channels."""
        if self.selection == "online":  # per-block channel indices: the reference path
            return None
        k, dim = blocks.keys, self.spec.head_dim
        index = self.high_index(selection)[0]  # [H, k]
        high = channel_mask(index, dim)[:, 0]  # [H, D]
        every, _, _ = every_channel(*high.shape, high.device)
        shift = self.high_bits - self.low_bits
        planes = [Plane(k.low[0], self.low_bits, every, torch.where(high, 2.0**shift, 1.0)),
                  Plane(k.high[0], shift, index, torch.ones_like(index, dtype=torch.float32))]
        offset = (~high).float() * (0.5 if self.center else 0.0)  # on the keys' device
        keys = ChannelKeys(planes, k.scale[0].squeeze(-2), k.minimum[0].squeeze(-2), offset)
        return KernelView(keys, self.values_view(blocks))

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        k = blocks.keys
        rows = k.low.shape[:-1]  # [B, n]
        heads, dim, group = self.spec.n_kv_heads, self.spec.head_dim, self.group
        # [B, n, H, k] (online: each block's), or [B, 1, H, k]
        index = k.index.long() if k.index is not None else self.high_index(selection)[:, None]
        count = index.shape[-1]
        shift = self.high_bits - self.low_bits
        codes = unpack(k.low, self.low_bits, heads * group * dim, group)
        codes = codes.view(*rows, heads, dim, group).transpose(-1, -2)  # [*rows, H, G, D]
        refine = unpack(k.high, shift, heads * group * count, group)
        refine = refine.view(*rows, heads, count, group).transpose(-1, -2)  # [*rows, H, G, k]
        where = _expand(index, group).expand(*rows, heads, group, count)
        codes = codes.scatter(-1, where, (codes.gather(-1, where) << shift) | refine)  # uint8
        high = channel_mask(index, dim)  # [B, n|1, H, 1, D]
        offset = (~high).to(dtype) * 0.5 if self.center else 0.0
        keys = reconstruct(codes, k.scale, k.minimum, offset, dtype)
        return keys, self.decode_values(blocks, dtype)


def _count(x: torch.Tensor) -> torch.Tensor:
    """Tokens per sequence of x [B, H, T, D]: [B] float32."""
    return torch.full((x.shape[0],), float(x.shape[-2]), device=x.device)


def _expand(index: torch.Tensor, tokens: int) -> torch.Tensor:
    """[..., H, k] -> [..., H, tokens, k] for gathering along channels."""
    return index.unsqueeze(-2).expand(*index.shape[:-1], tokens, index.shape[-1])
