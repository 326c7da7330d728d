"""``kivi``: KIVI (Liu et al., 2024), the uniform baseline.

Keys per channel over groups of 32 tokens, values per token over groups of 32 channels, both
asymmetric min-max at 2 or 4 bits; a full-precision residual of 128 tokens and no sink.
It is ``kxvy`` with KIVI's settings and bit widths.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvmix.methods.kxvy import Bits, KxVy
from kvmix.methods.registry import register


@register
@dataclass
class Kivi(KxVy):
    """KIVI: key_bits, value_bits in {2, 4}; group 32 tokens (keys), value_group 32 channels.

    Key bits per element: ``key_bits + 32/group``; value bits: ``value_bits + 32/value_group``.
    """

    name: ClassVar[str] = "kivi"
    summary: ClassVar[str] = "KIVI: per-channel keys, per-token values, 2 or 4 bits"
    presets: ClassVar[dict] = {"kivi2": {"key_bits": 2, "value_bits": 2},
                               "kivi4": {"key_bits": 4, "value_bits": 4}}
    allowed_bits: ClassVar[tuple[int, ...]] = (2, 4)

    key_bits: Bits = 2
    value_bits: Bits = 2
    allowed: tuple[int, ...] = (2, 4)
