"""``kitty``: Kitty, mixed-precision keys by channel magnitude (the PN-Mix paper's baseline).

Per-channel 2-bit keys over groups of ``group`` tokens, with the top ``ratio`` key channels of
each (sequence, layer, KV head) by mean |k| over the prompt promoted to 4 bits. The choice is made
once at prefill and kept as a D-bit mask per head and layer. Storage is PN-Mix's uniform planes:
a 2-bit plane for every channel plus a 2-bit refinement plane for the promoted channels only,
one float16 scale and minimum per channel; values per token at ``value_bits``.

Key bits per element: ``low_bits + (promoted/D)·(high_bits - low_bits) + 32/group``
(defaults: 2 + 2·round(0.1·D)/D + 0.25), plus the mask. Parameters as ``pnmix``; the defaults
are Kitty's (min-max quantizers, ``criterion=key_magnitude``, sink 32, residual 128, group 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmix.methods.pnmix import PNMix
from kvmix.methods.registry import register


@register
@dataclass
class Kitty(PNMix):
    """Kitty: 2-bit per-channel keys, the top 10% channels by mean |k| at 4 bits."""

    name: ClassVar[str] = "kitty"
    summary: ClassVar[str] = "Kitty: 2-bit keys, top channels by mean |k| promoted to 4 bits"
    presets: ClassVar[dict] = {}

    ratio: float = 0.1
    high_bits: int = 4
    low_bits: int = 2
    one_bit_correction: bool = False
    criterion: str = "key_magnitude"

    def high_channels(self, head_dim: int) -> int:
        """Kitty promotes channels, not pairs: round(ratio·D)."""
        return round(self.ratio * head_dim)

    @classmethod
    def describe(cls) -> str:
        return ("key bits = low_bits + promoted share·(high_bits - low_bits) + 32/group "
                "+ D mask bits per head; value bits = value_bits + 32/value_group")
