"""``chanmix``: ChanMix, per-channel precision classes averaging 2 key bits (docs/guide/methods.md).

Channels differ in sensitivity. At prefill, once, each (sequence, layer, KV head) sorts its key
channels into four classes, in this order:

1. **retrieval** (4 bits, ``retrieval`` = 1/16 of channels): the largest query-key contribution
   ``mean over the group's query heads of E|q_c| · E|k_c|``;
2. **outlier** (3 bits, ``outlier`` = 1/8): of the rest, the widest key range (max - min);
3. **subnormal** (1 bit, ``subnormal`` = 1/4): of the rest, the smallest mean |k|;
4. **normal** (2 bits): everything else (9/16).

With these fractions the average is exactly 2 bits (4/16 + 3/8 + 2·9/16 + 1/4 = 2) whenever the
head dim is a multiple of 16. The original's exact criteria and fractions are not public here:
they were reconstructed from its paper's description, and every class uses the plain asymmetric
min-max quantizer (no bin-center correction, which is PN-Mix's contribution).

Storage: the class of every channel as a 2-bit code (B·L·H_kv·D·2 bits, kept for the whole
generation); per block, each class's channels packed at its own width, and one float16 scale
and minimum per channel. Values per token at ``value_bits``.
Key bits per element: ``Σ_c share_c·bits_c + 32/group`` plus the class map.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from kvmix.core.importance import group_mean, key_scores, mask_index, top_mask
from kvmix.core.packing import pack, unpack
from kvmix.core.quantizers import quantize_codes, reconstruct
from kvmix.methods.base import (
    MIXED_KEYS,
    PER_CHANNEL_KEYS,
    STAT_BITS,
    Blocks,
    ChannelKeys,
    KernelView,
    ModelSpec,
    PerTokenValues,
    Plane,
    select_by_sums,
)
from kvmix.methods.registry import register

CLASS_BITS = (4, 3, 2, 1)  # retrieval, outlier, normal, subnormal: class id = position here


@dataclass
class ClassKeys:
    """One block of ChanMix keys: per class, its channels' codes packed at the class width."""

    codes: tuple[torch.Tensor, ...] = field(metadata={"kind": "codes"})
    scale: torch.Tensor = field(metadata={"kind": "scales"})  # [*rows, H, 1, D] float16
    minimum: torch.Tensor = field(metadata={"kind": "zeros"})  # [*rows, H, 1, D] float16


@dataclass
class ChannelClasses:
    """Every channel's class id, 2 bits each: [B, bytes]."""

    ids: torch.Tensor = field(metadata={"kind": "masks"})


@register
@dataclass
class ChanMix(PerTokenValues):
    """ChanMix: per-channel classes at 4/3/2/1 bits, chosen at prefill, 2 bits on average."""

    name: ClassVar[str] = "chanmix"
    summary: ClassVar[str] = "ChanMix: channel classes at 4/3/2/1 bits, 2 bits on average"
    fast_path: ClassVar[str] = "cpu op + triton (one plane per class)"

    retrieval: float = 1 / 16
    outlier: float = 1 / 8
    subnormal: float = 1 / 4
    group: int = 128
    sink: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        super().__post_init__()
        shares = (self.retrieval, self.outlier, self.subnormal)
        for name, share in zip(("retrieval", "outlier", "subnormal"), shares, strict=True):
            if not isinstance(share, (int, float)) or not 0 <= share <= 1:
                raise ValueError(f"{name}={share!r} is invalid; expected a share in [0, 1]")
        if sum(shares) > 1:
            raise ValueError(f"retrieval + outlier + subnormal = {sum(shares):.3f} exceeds 1")

    def counts(self, head_dim: int) -> tuple[int, int, int, int]:
        """Channels per class (retrieval, outlier, normal, subnormal)."""
        retrieval, outlier, subnormal = (round(s * head_dim) for s in
                                         (self.retrieval, self.outlier, self.subnormal))
        return retrieval, outlier, head_dim - retrieval - outlier - subnormal, subnormal

    def bits(self, layer: int, dtype: torch.dtype) -> tuple[float, float]:
        dim = self.spec.head_dim
        key = sum(n * b for n, b in zip(self.counts(dim), CLASS_BITS, strict=True)) / dim
        return key + STAT_BITS / self.group, self.value_bits_per_element()

    def engine_limits(self) -> list[str]:
        return [PER_CHANNEL_KEYS, MIXED_KEYS]

    def selection_bits(self, spec: ModelSpec) -> int:
        return 2 * spec.n_kv_heads * spec.head_dim

    @classmethod
    def describe(cls) -> str:
        return ("key bits = Σ share·bits over classes 4/3/2/1 (2.0 by default) + 32/group "
                "+ 2 class bits per channel, head and layer; "
                "value bits = value_bits + 32/value_group")

    def select(self, queries: torch.Tensor, keys: torch.Tensor, layer: int,
               values: torch.Tensor | None = None) -> ChannelClasses:
        return select_by_sums(self, queries, keys, layer, values)

    def query_sums(self, queries: torch.Tensor) -> torch.Tensor:
        return group_mean(queries.float().abs().sum(-2), self.spec.n_kv_heads)  # [B, H, D]

    def select_from(self, query_sums: torch.Tensor | None, tokens: torch.Tensor,
                    keys: torch.Tensor, layer: int, values: torch.Tensor | None = None
                    ) -> ChannelClasses:
        classes = self.classify(query_sums / tokens[:, None, None], keys)  # [B, H, D]
        return ChannelClasses(pack(classes, 2))

    def classify(self, query_mean: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Class ids [B, H, D] (0 retrieval, 1 outlier, 2 normal, 3 subnormal) from the mean
        |q| of each channel over the group's query heads [B, H, D] and the keys [B, H, T, D]."""
        contribution = query_mean * keys.float().abs().mean(-2)
        spread = key_scores("key_range", None, keys, None, None)
        smallness = -key_scores("key_magnitude", None, keys, None, None)
        classes = torch.full(keys.shape[:2] + keys.shape[-1:], 2, dtype=torch.uint8,
                             device=keys.device)
        retrieval, outlier, _, subnormal = self.counts(keys.shape[-1])
        for class_id, score, count in ((0, contribution, retrieval), (1, spread, outlier),
                                       (3, smallness, subnormal)):
            free = classes == 2  # still normal: not yet claimed by an earlier class
            chosen = top_mask(torch.where(free, score, -torch.inf), count)
            classes[chosen] = class_id
        return classes

    def class_index(self, selection: ChannelClasses, batch: int) -> list[torch.Tensor]:
        """Per class, its channels' indices: [B, H, count_c] (sorted)."""
        heads, dim = self.spec.n_kv_heads, self.spec.head_dim
        classes = unpack(selection.ids, 2, heads * dim, dim).view(batch, heads, dim)
        return [mask_index(classes == c, n) for c, n in enumerate(self.counts(dim))]

    def encode(self, keys: torch.Tensor, values: torch.Tensor, layer: int,
               selection: Any) -> tuple[ClassKeys, Any]:
        # keys, values: [B, H, G, D]
        scale = torch.zeros_like(keys[..., :1, :], dtype=torch.float16)  # [B, H, 1, D]
        minimum = torch.zeros_like(scale)
        codes = []
        for index, bits in zip(self.class_index(selection, keys.shape[0]), CLASS_BITS,
                               strict=True):
            part = keys.gather(-1, _expand(index, keys.shape[-2]))  # [B, H, G, n]
            c, s, m = quantize_codes(part, bits, -2)
            codes.append(pack(c.transpose(-1, -2), bits))  # rows: a channel's tokens
            scale.scatter_(-1, index.unsqueeze(-2), s)
            minimum.scatter_(-1, index.unsqueeze(-2), m)
        stored = ClassKeys(tuple(codes), scale, minimum)
        return stored, self.encode_values(values)

    def kernel_view(self, blocks: Blocks, layer: int, selection: Any) -> KernelView:
        stored = blocks.keys
        scale = stored.scale[0].squeeze(-2)  # [n, H, D]
        planes = [Plane(codes[0], bits, index[0], torch.ones_like(index[0], dtype=torch.float32))
                  for codes, index, bits in zip(stored.codes, self.class_index(selection, 1),
                                                CLASS_BITS, strict=True)]
        keys = ChannelKeys(planes, scale, stored.minimum[0].squeeze(-2),
                           torch.zeros(scale.shape[1:], device=scale.device))
        return KernelView(keys, self.values_view(blocks))

    def decode(self, blocks: Blocks, layer: int, selection: Any,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        stored = blocks.keys
        rows = stored.scale.shape[:-3]  # [B, n]
        heads, group, dim = self.spec.n_kv_heads, self.group, self.spec.head_dim
        keys = torch.zeros(*rows, heads, group, dim, dtype=dtype, device=stored.scale.device)
        for packed, index, bits in zip(stored.codes, self.class_index(selection, rows[0]),
                                       CLASS_BITS, strict=True):
            n = index.shape[-1]
            codes = unpack(packed, bits, heads * group * n, group)
            codes = codes.view(*rows, heads, n, group).transpose(-1, -2)  # [*rows, H, G, n]
            where = _expand(index[:, None], group).expand(*rows, heads, group, n)
            scale = stored.scale.gather(-1, where[..., :1, :])
            minimum = stored.minimum.gather(-1, where[..., :1, :])
            keys.scatter_(-1, where, reconstruct(codes, scale, minimum, 0.0, dtype))
        return keys, self.decode_values(blocks, dtype)


def _expand(index: torch.Tensor, tokens: int) -> torch.Tensor:
    """[..., H, k] -> [..., H, tokens, k] for gathering along channels."""
    return index.unsqueeze(-2).expand(*index.shape[:-1], tokens, index.shape[-1])
