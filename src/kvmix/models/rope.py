"""RoPE channel pairs, read from the model itself (docs/guide/methods.md, Models).

RoPE rotates channels two at a time; which two depends on the model (``rotate_half``: ``j`` with
``j + D/2``; interleaved: ``2j`` with ``2j+1``). Rather than assume, kvmix rotates the unit vectors
``e_j`` with the model's own rotary embedding and reads off which channel each one mixes with.
Hybrid models (Gemma-3) keep one set of frequencies per layer type (``full_attention_inv_freq``);
kvmix packs full-attention layers, so it reads those.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

PROBE_POSITIONS = (1, 7, 123, 1001)
FULL_ATTENTION = "full_attention"


def rope_pairs(model: Any) -> torch.Tensor | None:
    """[D/2, 2] channel indices (a, b) of each pair, or None when the layout cannot be read."""
    rotary = _rotary_module(model)
    if rotary is None:
        return None
    apply = getattr(sys.modules[type(rotary).__module__], "apply_rotary_pos_emb", None)
    if apply is None:
        return None
    mixing = rotation_mixing(rotary, apply)  # [D, D]
    return _pairs_from_mixing(mixing)


def rotation_mixing(rotary: torch.nn.Module, apply) -> torch.Tensor:
    """How much each unit vector e_j leaks into each channel, summed over probe positions."""
    dim = int(_frequencies(rotary).numel() * 2)
    basis = torch.eye(dim).view(1, dim, 1, dim)  # D "heads", one token, each a unit vector
    total = torch.zeros(dim, dim)
    per_type = {} if hasattr(rotary, "inv_freq") else {"layer_type": FULL_ATTENTION}
    for position in PROBE_POSITIONS:
        cos, sin = rotary(basis.view(1, dim, dim)[:, :1], torch.tensor([[position]]), **per_type)
        rotated, _ = apply(basis, basis, cos.float(), sin.float())
        total += rotated.view(dim, dim).abs()
    return total


def layout_name(pairs: torch.Tensor) -> str:
    dim = pairs.numel()
    if torch.equal(pairs, torch.stack([torch.arange(dim // 2), torch.arange(dim // 2, dim)], 1)):
        return "rotate_half"
    if torch.equal(pairs, torch.arange(dim).view(-1, 2)):
        return "interleaved"
    return "custom"


def _rotary_module(model: Any) -> torch.nn.Module | None:
    for module in model.modules():
        if type(module).__name__.endswith("RotaryEmbedding") and _frequencies(module) is not None:
            return module
    return None


def _frequencies(rotary: torch.nn.Module) -> torch.Tensor | None:
    """The inverse frequencies the full-attention layers use (a shared or per-type buffer)."""
    return getattr(rotary, "inv_freq", getattr(rotary, f"{FULL_ATTENTION}_inv_freq", None))


def _pairs_from_mixing(mixing: torch.Tensor) -> torch.Tensor | None:
    dim = mixing.shape[0]
    off = mixing.clone().fill_diagonal_(0)
    partner = off.argmax(1)  # [D]
    involution = torch.equal(partner[partner], torch.arange(dim))
    unmixed = (off.amax(1) == 0).any() or (partner == torch.arange(dim)).any()
    if dim % 2 or not involution or unmixed:
        return None
    first = torch.arange(dim)[torch.arange(dim) < partner]
    return torch.stack([first, partner[first]], 1)  # [D/2, 2]
