"""WUSH-KV calibration: second moments of post-RoPE keys, the group's queries and values on
calibration text, and the WUSH-KV transforms built from them (WUSH-KV, arXiv:2609.38121).

Per layer and KV head: ``Σ_k = E[k kᵀ]``, ``Σ_q`` = the mean over the group's query heads of
``E[q qᵀ]``, ``Σ_v = E[v vᵀ]``. Keys use the query side as their weight (W with WᵀW = Σ_q + λI);
values use the W_O columns of the group's query heads. Every kind (identity, Hadamard, WUS, WUSH)
is computed in float64 (``kvmix calibrate`` saves them with the model name, shapes, damping, data
and a checksum).
"""

from __future__ import annotations

import torch
from rich.progress import Progress

from kvmix.core.transforms import KINDS, block_transform
from kvmix.jobs.report import console
from kvmix.models.weights import output_weights
from kvmix.runtime.attention import make_cache, observe_attention


@torch.no_grad()
def collect_moments(model, ids: torch.Tensor, chunk: int) -> dict[str, torch.Tensor]:
    """Mean second moments over the tokens of ``ids``: keys, queries, values [L, H, D, D]."""
    sums: dict[str, dict[int, torch.Tensor]] = {"keys": {}, "queries": {}, "values": {}}

    def observe(layer: int, query, key, value, scaling) -> None:
        new = query.shape[-2]
        heads = key.shape[1]
        grouped = query.double().unflatten(1, (heads, -1))  # [B, H, g, T, D]
        parts = {"keys": key[..., -new:, :].double(), "values": value[..., -new:, :].double()}
        moments = {side: torch.einsum("bhtd,bhte->hde", x, x) for side, x in parts.items()}
        moments["queries"] = torch.einsum("bhgtd,bhgte->hde", grouped, grouped) / grouped.shape[2]
        for side, moment in moments.items():
            sums[side][layer] = sums[side].get(layer, 0) + moment

    cache = make_cache(model, "full")
    ids = ids.to(model.device)
    with observe_attention(model, observe), Progress(console=console, transient=True) as bar:
        task = bar.add_task("calibrating", total=ids.shape[1])
        for start in range(0, ids.shape[1], chunk):
            model(ids[:, start : start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
            bar.advance(task, min(chunk, ids.shape[1] - start))
    count = ids.numel()
    return {side: torch.stack([per[layer] for layer in sorted(per)]) / count
            for side, per in sums.items()}


def compute_transforms(model, moments: dict[str, torch.Tensor], block: int,
                       damping: float) -> dict[str, dict[str, torch.Tensor]]:
    """T_k and T_v [L, H, D, D] of every kind, on the CPU (where the model runs, a GPU too)."""
    outputs = [w.cpu() for w in output_weights(model)]  # per layer [H, g·hidden, D]
    moments = {side: m.cpu() for side, m in moments.items()}
    layers, heads, dim, _ = moments["keys"].shape
    eye = torch.eye(dim, dtype=torch.float64)
    result: dict[str, dict[str, torch.Tensor]] = {"keys": {}, "values": {}}
    for kind in KINDS:
        keys, values = torch.empty(layers, heads, dim, dim, dtype=torch.float64), torch.empty(
            layers, heads, dim, dim, dtype=torch.float64)
        for layer in range(layers):
            for head in range(heads):
                sigma_q = moments["queries"][layer, head]
                query_side = torch.linalg.cholesky(
                    sigma_q + damping * sigma_q.diagonal().mean() * eye, upper=True)  # WᵀW ≈ Σ_q
                keys[layer, head] = block_transform(moments["keys"][layer, head], query_side,
                                                    kind, block, damping)
                values[layer, head] = block_transform(moments["values"][layer, head],
                                                      outputs[layer][head], kind, block, damping)
        result["keys"][kind], result["values"][kind] = keys, values
    return result
