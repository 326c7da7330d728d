"""The key and value projection weights of a model, per layer and KV head (docs/guide/methods.md).

Separate ``k_proj``/``v_proj`` (Llama, Mistral, Qwen, Gemma, ...) and a fused ``qkv_proj`` laid out
as [q; k; v] rows (Phi-3) are read; anything else is refused with a message naming what was found.
Biases are reported beside the weights, not folded into the norms.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class KVWeights:
    """One layer's projections: keys and values [H_kv, D, hidden]; biases [H_kv, D] or None."""

    keys: torch.Tensor
    values: torch.Tensor
    key_bias: torch.Tensor | None
    value_bias: torch.Tensor | None


def attention_modules(model: Any) -> list[torch.nn.Module]:
    """The self-attention module of every decoder layer, in layer order."""
    found = [m for m in model.modules() if hasattr(m, "layer_idx") and _projection_names(m)]
    if not found:
        raise ValueError(f"{type(model).__name__}: no attention modules with k_proj/v_proj or a "
                         "fused qkv_proj were found; kvmix cannot read its key/value weights")
    return sorted(found, key=lambda m: m.layer_idx)


def kv_weights(model: Any) -> list[KVWeights]:
    return list(iter_kv_weights(model))


def iter_kv_weights(model: Any) -> Iterator[KVWeights]:
    """Each layer's projections in turn, as float32 copies: one layer's alive at a time when
    consumed as it goes (``squared_frobenius``)."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return (_read(m, heads, kv_heads, head_dim) for m in attention_modules(model))


def _read(module: torch.nn.Module, heads: int, kv_heads: int, dim: int) -> KVWeights:
    """One layer's weights; an offloaded layer (accelerate's hooks keep its weights on the meta
    device between forwards, as ``device_map`` with ``cpu``/``disk`` entries does) is loaded for
    the read, through the hook of each projection, and copied out to the CPU."""
    if not any(p.is_meta for p in module.parameters()):
        return _layer_weights(module, heads, kv_heads, dim)
    from accelerate.utils import align_module_device, has_offloaded_params

    with contextlib.ExitStack() as loaded:
        for part in filter(has_offloaded_params, module.modules()):
            loaded.enter_context(align_module_device(part, torch.device("cpu")))
        w = _layer_weights(module, heads, kv_heads, dim)
        return KVWeights(w.keys.clone(), w.values.clone(),
                         None if w.key_bias is None else w.key_bias.clone(),
                         None if w.value_bias is None else w.value_bias.clone())


def weight_norms(weights: list[KVWeights]) -> dict[str, torch.Tensor]:
    """Spectral and Frobenius norms of W_K and W_V per layer [L] and per KV head [L, H_kv]."""
    out = {}
    for side in ("keys", "values"):
        stacked = torch.stack([getattr(w, side).double() for w in weights])  # [L, H, D, hidden]
        whole = stacked.flatten(1, 2)  # [L, H·D, hidden]
        out[f"{side}_spectral"] = torch.linalg.matrix_norm(whole, ord=2)
        out[f"{side}_frobenius"] = torch.linalg.matrix_norm(whole)
        out[f"{side}_spectral_heads"] = torch.linalg.matrix_norm(stacked, ord=2)
        out[f"{side}_frobenius_heads"] = torch.linalg.matrix_norm(stacked)
    return out


def _projection_names(module: torch.nn.Module) -> tuple[str, ...]:
    if hasattr(module, "k_proj") and hasattr(module, "v_proj"):
        return ("k_proj", "v_proj")
    if hasattr(module, "qkv_proj"):
        return ("qkv_proj",)
    return ()


def _layer_weights(module: torch.nn.Module, heads: int, kv_heads: int, dim: int) -> KVWeights:
    names = _projection_names(module)
    if names == ("k_proj", "v_proj"):
        k, v = module.k_proj, module.v_proj
        return KVWeights(_heads(k.weight, kv_heads), _heads(v.weight, kv_heads),
                         _bias(k.bias, kv_heads), _bias(v.bias, kv_heads))
    weight, bias = module.qkv_proj.weight, module.qkv_proj.bias  # rows: [q; k; v]
    sizes = [heads * dim, kv_heads * dim, kv_heads * dim]
    if weight.shape[0] != sum(sizes):
        raise ValueError(f"fused qkv_proj of layer {module.layer_idx} has {weight.shape[0]} rows, "
                         f"not q+k+v = {sum(sizes)}: an unsupported layout")
    _, wk, wv = weight.detach().split(sizes)
    _, bk, bv = bias.detach().split(sizes) if bias is not None else (None, None, None)
    return KVWeights(_heads(wk, kv_heads), _heads(wv, kv_heads), _bias(bk, kv_heads),
                     _bias(bv, kv_heads))


def _heads(weight: torch.Tensor, kv_heads: int) -> torch.Tensor:
    return weight.detach().float().unflatten(0, (kv_heads, -1))  # [H_kv, D, hidden]


def _bias(bias: torch.Tensor | None, kv_heads: int) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float().view(kv_heads, -1)


def squared_frobenius(weights: Iterable[KVWeights]) -> torch.Tensor:
    """[L, 2] float64: ‖W_K,l‖²_F and ‖W_V,l‖²_F, the weights of the bit-allocation proxy."""
    return torch.tensor([[w.keys.double().pow(2).sum().item(),
                          w.values.double().pow(2).sum().item()] for w in weights],
                        dtype=torch.float64)


def output_weights(model: Any) -> list[torch.Tensor]:
    """Per layer, W_O's columns grouped by KV head: [H_kv, g·hidden, D] (the rows of each query
    head of the group stacked), the weight side of the value transforms."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    out = []
    for module in attention_modules(model):
        if not hasattr(module, "o_proj"):
            raise ValueError(f"layer {module.layer_idx} has no o_proj: unsupported layout")
        weight = module.o_proj.weight.detach().double()  # [hidden, Hq·D]
        per_head = weight.unflatten(1, (heads, -1)).permute(1, 0, 2)  # [Hq, hidden, D]
        out.append(per_head.unflatten(0, (kv_heads, -1)).flatten(1, 2))  # [H, g·hidden, D]
    return out
