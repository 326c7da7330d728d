"""Key-priority bit allocation (docs/guide/methods.md): per-layer key and value bits under an
average budget.

Minimises the norm-weighted error proxy ``Σ_l ‖W_K,l‖² 4^(−b_K,l) + ‖W_V,l‖² 4^(−b_V,l)`` by greedy
integer water-filling: every width starts at the smallest allowed one, then the step with the
largest proxy reduction per extra bit is taken while it fits the budget.
"""

from __future__ import annotations

import torch


def allocate(weights: torch.Tensor, budget: float, allowed: tuple[int, ...]) -> torch.Tensor:
    """weights: [L, 2] squared norms (keys, values) -> bits [L, 2] averaging exactly ``budget``."""
    allowed = tuple(sorted(set(allowed)))
    if not allowed[0] <= budget <= allowed[-1]:
        raise ValueError(f"budget={budget} is outside the allowed widths "
                         f"[{allowed[0]}, {allowed[-1]}]")
    total = budget * weights.numel()
    if abs(total - round(total)) > 1e-9:
        raise ValueError(f"budget={budget} × {weights.numel()} key/value slots is not a whole "
                         "number of bits")
    bits = torch.full(weights.shape, allowed[0], dtype=torch.long)
    left = round(total) - int(bits.sum())
    while left > 0:
        step = _best_step(weights, bits, allowed, left)
        if step is None:
            break
        index, width = step
        left -= width - int(bits.view(-1)[index])
        bits.view(-1)[index] = width
    if left:
        raise ValueError(f"budget={budget} cannot be met exactly with widths {list(allowed)}")
    return bits


def _best_step(weights: torch.Tensor, bits: torch.Tensor, allowed: tuple[int, ...],
               left: int) -> tuple[int, int] | None:
    best, best_gain = None, -1.0
    for index, (w, b) in enumerate(zip(weights.view(-1).tolist(), bits.view(-1).tolist(),
                                       strict=True)):
        wider = [a for a in allowed if a > b]
        if not wider or wider[0] - b > left:
            continue
        gain = w * (4.0**-b - 4.0**-wider[0]) / (wider[0] - b)
        if gain > best_gain:
            best, best_gain = (index, wider[0]), gain
    return best
