"""Long generation through the cache (docs/guide/evaluation.md): where a method's greedy output
leaves the ``full`` cache's, and how its next-token distributions drift, along ``full``'s trajectory
(teacher-forced) and along its own (free-running, re-scored by ``full``). The gap between the two is
error compounding: the method reading its own quantized history.

Batches are left-padded; every sequence keeps its own cache rows, so a batch gives each prompt
exactly what it would get alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvmix.runtime.attention import make_cache
from kvmix.runtime.folding import prepare_model


@dataclass
class Paired:
    """Greedy tokens [B, n] of the followed cache and KL(reference ‖ method) [B, n] of the
    distributions that predict them (float32)."""

    tokens: torch.Tensor
    kl: torch.Tensor


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> ids and attention mask [B, T], right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, prompt in enumerate(prompts):
        ids[b, width - len(prompt):] = torch.tensor(prompt)
        mask[b, width - len(prompt):] = 1
    return ids, mask


@torch.no_grad()
def paired_decode(model, reference: str, method: str, prompts: list[list[int]], steps: int,
                  pad: int, follow: str, backend: str = "auto",
                  progress: Callable[[int], None] | None = None) -> Paired:
    """Both caches read the same left-padded prompts, then the same ``steps`` greedy tokens one
    decode step at a time; the tokens are the greedy choices of ``follow`` (``"reference"``:
    teacher-forced along the reference's trajectory; ``"method"``: free-running, the method
    reading its own quantized history while the reference re-scores it)."""
    if follow not in ("reference", "method"):
        raise ValueError(f"follow={follow!r} is invalid; valid: reference, method")
    runs = []
    for name in (reference, method):
        runner = prepare_model(model, name)
        runs.append((runner, make_cache(runner, name, backend)))
    ids, mask = (t.to(runs[0][0].device) for t in left_pad(prompts, pad))
    step, position = ids, _positions(mask)
    tokens, kl = [], []
    for _ in range(steps):
        logits = [_last(runner(step, attention_mask=mask, cache=cache, use_cache=True,
                               position_ids=position, logits_to_keep=1))
                  for runner, cache in runs]  # [B, V] each
        kl.append(_kl(*logits))
        step = logits[0 if follow == "reference" else 1].argmax(-1, keepdim=True)  # [B, 1]
        tokens.append(step[:, 0])
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = _positions(mask)[:, -1:]
        if progress:
            progress(1)
    return Paired(torch.stack(tokens, 1).cpu(), torch.stack(kl, 1).float().cpu())


def first_divergence(tokens: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """[B, n] x [B, n] -> [B]: the first position where they differ (n when they never do)."""
    differs = tokens != reference
    return torch.where(differs.any(1), differs.int().argmax(1), tokens.shape[1])


def survival(divergence: list[int], length: int) -> list[float]:
    """Share of prompts still identical after t tokens, t = 0..length."""
    count = max(len(divergence), 1)
    return [sum(d > t for d in divergence) / count for t in range(length + 1)]


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions a left-padded row's tokens hold, as generate gives them: [B, T]."""
    return (mask.cumsum(-1) - 1).clamp_min(0)


def _last(output) -> torch.Tensor:
    return torch.log_softmax(output.logits[:, -1].float(), dim=-1)  # [B, V]


def _kl(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """[B, V] log-probabilities -> [B] KL(reference ‖ other)."""
    return (reference.exp() * (reference - other)).sum(-1)
