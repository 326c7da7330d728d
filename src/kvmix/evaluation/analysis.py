"""Analyses over captured attention inputs: attention KL of a method's reconstructed keys
(docs/guide/evaluation.md) and the agreement of PN-Mix's separable pair score with the causal one
(docs/guide/methods.md).

``capture`` runs the model at full precision over a context and the decode tokens after it, and
keeps each layer's post-RoPE queries, keys and values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmix.core.importance import causal_pair_score, scores, spearman, top_overlap
from kvmix.methods import Method
from kvmix.models.rope import rope_pairs
from kvmix.runtime.attention import make_cache, observe_attention
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.layer import take_pending


@dataclass
class Captured:
    """Per layer: prefill queries [B, Hq, C, D], keys and values [B, H, C, D], the queries of
    the decode tokens [B, Hq, N, D], and the attention scaling."""

    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    decode_queries: dict[int, torch.Tensor] = field(default_factory=dict)
    scaling: dict[int, float] = field(default_factory=dict)


@torch.no_grad()
def capture(model, ids: torch.Tensor, context: int) -> Captured:
    """Full-precision pass: prefill ids[:, :context], then ids[:, context:] as decode queries."""
    captured = Captured()

    def prefill(layer: int, query, key, value, scaling) -> None:
        captured.queries[layer], captured.keys[layer] = query, key
        captured.values[layer], captured.scaling[layer] = value, scaling

    def decode(layer: int, query, key, value, scaling) -> None:
        captured.decode_queries[layer] = query

    cache = make_cache(model, "full")  # exact: reproduces DynamicCache
    ids = ids.to(model.device)
    with observe_attention(model, prefill):
        model(ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)
    if ids.shape[1] > context:
        with observe_attention(model, decode):
            model(ids[:, context:], cache=cache, use_cache=True)
    return captured


def attention_kl(model, captured: Captured, method: str | Method) -> torch.Tensor:
    """KL(softmax with exact keys ‖ softmax with the method's keys) for the decode queries over
    the quantized context, per layer and query head, averaged over queries: [L, Hq]."""
    cache = make_cache(prepare_model(model, method), method)
    rows = []
    for layer in sorted(captured.keys):
        keys, scale = captured.keys[layer], captured.scaling[layer]
        cache.update(keys, captured.values[layer], layer)
        prompt = cache.method.transform_queries(captured.queries[layer], layer)
        take_pending().attend(prompt, None, scale)  # prefill: select, fill, flush
        approx = cache.layers[layer].history()[0]  # [B, H, C, D]
        query = captured.decode_queries[layer].float()
        exact = torch.log_softmax(_logits(query, keys.float(), scale), -1)  # [B, Hq, N, C]
        rotated = cache.method.transform_queries(query, layer)  # the cache's key space
        quant = torch.log_softmax(_logits(rotated, approx.float(), scale), -1)
        rows.append((exact.exp() * (exact - quant)).sum(-1).mean((0, 2)))  # [Hq]
    return torch.stack(rows)


def pair_score_agreement(model, captured: Captured, ratio: float) -> dict[str, torch.Tensor]:
    """Spearman correlation and top-``ratio`` overlap between PN-Mix's separable pair score and
    the causal score, per layer and KV head: each [L, Hkv]."""
    pairs = rope_pairs(model)
    if pairs is None:
        raise ValueError("pairscore needs RoPE channel pairs; this model's RoPE layout could "
                         "not be determined")
    rho, overlap = [], []
    for layer in sorted(captured.keys):
        queries, keys = captured.queries[layer], captured.keys[layer]
        separable = scores("qk_pair_norm", queries, keys, None, pairs)  # [B, H, P]
        causal = causal_pair_score(queries, keys, pairs)
        rho.append(spearman(separable, causal).mean(0))
        overlap.append(top_overlap(separable, causal, ratio).mean(0))
    return {"spearman": torch.stack(rho), "overlap": torch.stack(overlap)}


def _logits(query: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    # query: [B, Hq, N, D]; keys: [B, H, C, D] -> [B, Hq, N, C]
    keys = keys.repeat_interleave(query.shape[1] // keys.shape[1], dim=1)
    return query @ keys.transpose(-1, -2) * scale


def layer_errors(captured: Captured, method, outputs: list[torch.Tensor],
                 bits: int) -> dict[str, list[float]]:
    """Relative error per layer of scores (keys quantized) and of W_O outputs (values)."""
    transforms = method.transform_set()
    keys_t = transforms.keys[method.transform].float()  # [L, H, D, D]
    values_t = transforms.values[method.transform].float()
    result = {"keys": [], "values": []}
    for layer in sorted(captured.keys):
        query, scale = captured.decode_queries[layer].float(), captured.scaling[layer]
        keys, values = captured.keys[layer].float(), captured.values[layer].float()
        group = query.shape[1] // keys.shape[1]
        k_hat = _round_trip(method, keys, keys_t[layer], bits)
        v_hat = _round_trip(method, values, values_t[layer], bits)
        exact = query @ keys.repeat_interleave(group, 1).transpose(-1, -2) * scale  # [B,Hq,N,C]
        approx = query @ k_hat.repeat_interleave(group, 1).transpose(-1, -2) * scale
        result["keys"].append(_relative(approx, exact))
        weights = exact.softmax(-1)
        w_o = outputs[layer].float().unflatten(1, (group, -1))  # [H, g, hidden, D]
        out = _project(weights @ values.repeat_interleave(group, 1), w_o)
        out_hat = _project(weights @ v_hat.repeat_interleave(group, 1), w_o)
        result["values"].append(_relative(out_hat, out))
    return result


def _round_trip(method, x: torch.Tensor, transform: torch.Tensor, bits: int) -> torch.Tensor:
    # x: [B, H, C, D]; transform: [H, D, D] -> x̂ = Q(x Tᵀ) T^{-ᵀ}
    moved = torch.einsum("bhtd,hed->bhte", x, transform)
    restored = method.dequantize_tokens(method.quantize_tokens(moved, bits), torch.float32)
    return torch.einsum("bhte,hed->bhtd", restored, torch.linalg.inv(transform).transpose(-1, -2))


def _project(heads_out: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    # heads_out: [B, Hq, N, D]; w_o: [H, g, hidden, D] -> [B, N, hidden]
    return torch.einsum("bhnd,hod->bno", heads_out, w_o.flatten(0, 1))


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()
