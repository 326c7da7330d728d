"""Folding value transforms into the model's weights (WUSH-KV, arXiv:2609.38121).

``v' = T_v v`` is produced by ``W_V ← T_v W_V`` (and its bias) and undone inside ``W_O`` for every
query head of the group (``W_O,h ← W_O,h T_v^{-1}``), so values need no online work. By default
on a copy (the original model is never modified: library users keep using it), made once per
(model, transforms); ``inplace=True`` folds the model itself — no second copy of the weights (an
8B model's 16 GB) — and marks it, for a model loaded to run this method only (the CLI's).
Either way the folded model carries the transforms' checksum.
"""

from __future__ import annotations

import copy
import weakref
from typing import Any

import torch

from kvmix.methods import Method, parse_method
from kvmix.models.weights import attention_modules
from kvmix.runtime.attention import FOLDED
from kvmix.runtime.cache import model_spec

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the config.json entry of an exported folded model: {"id": fold id, "model": the name the
# transforms were calibrated for}, read where the model is built from its config (the vLLM plugin)
CONFIG_KEY = "kvmix_folded"


@torch.no_grad()
def fold_values(model: Any, values: torch.Tensor, fold_id: str) -> Any:
    """A copy of ``model`` whose value projections produce T_v v; values: [L, H, D, D]."""
    return _fold(copy.deepcopy(model), values, fold_id)


def prepare_model(model: Any, method: str | Method, inplace: bool = False) -> Any:
    """The model a method runs on: ``model`` itself, or (for methods that fold value
    transforms) a folded copy, made once per (model, transforms) and reused — or, with
    ``inplace``, ``model`` folded in place (once: folding it again for the same transforms is a
    no-op, for other transforms an error)."""
    method = parse_method(method)
    needed = method.value_fold(model_spec(model.config))
    if needed is None:
        return model
    values, fold_id = needed
    if inplace:
        return _fold_in_place(model, values, fold_id)
    copies = _COPIES.setdefault(model, {})
    if fold_id not in copies:
        copies[fold_id] = fold_values(model, values, fold_id)
    return copies[fold_id]


@torch.no_grad()
def _fold_in_place(model: Any, values: torch.Tensor, fold_id: str) -> Any:
    folded = getattr(model, FOLDED, None)
    if folded == fold_id:
        return model
    if folded is not None:
        raise ValueError(f"the model is already folded in place with transforms {folded}; "
                         f"folding {fold_id} too would compound them: load the model again")
    return _fold(model, values, fold_id)


def _fold(model: Any, values: torch.Tensor, fold_id: str) -> Any:
    """Fold T_v [L, H, D, D] into ``model``'s own weights and mark it."""
    config = model.config.get_text_config(decoder=True)
    group = config.num_attention_heads // values.shape[1]
    for module, transform in zip(attention_modules(model), values, strict=True):
        _fold_layer(module, transform, group)
    setattr(model, FOLDED, fold_id)
    return model


def _fold_layer(module: torch.nn.Module, transform: torch.Tensor, group: int) -> None:
    # transform: [H, D, D] float64
    if not (hasattr(module, "v_proj") and hasattr(module, "o_proj")):
        raise ValueError(f"layer {module.layer_idx}: folding needs separate v_proj and o_proj")
    v_proj, o_proj = module.v_proj, module.o_proj
    transform = transform.to(v_proj.weight.device)  # read from a file: on the CPU
    heads, dim = transform.shape[0], transform.shape[-1]
    weight = v_proj.weight.double().unflatten(0, (heads, dim))  # [H, D, hidden]
    v_proj.weight.copy_((transform @ weight).flatten(0, 1).to(v_proj.weight.dtype))
    if v_proj.bias is not None:
        bias = v_proj.bias.double().view(heads, dim, 1)
        v_proj.bias.copy_((transform @ bias).flatten().to(v_proj.bias.dtype))
    inverse = torch.linalg.inv(transform).repeat_interleave(group, 0)  # [Hq, D, D]
    out = o_proj.weight.double().unflatten(1, (-1, dim))  # [hidden, Hq, D]
    out = torch.einsum("ohd,hde->ohe", out, inverse)
    o_proj.weight.copy_(out.flatten(1, 2).to(o_proj.weight.dtype))
