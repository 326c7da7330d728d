"""llama.cpp's cache in bytes and slots: the ``llama.cpp:TYPE`` / ``llama.cpp:K/V`` rows, bytes per
cached token (``ggml_row_size`` of each side's type over the model's ``n_embd_k_gqa`` /
``n_embd_v_gqa``), and the most slots whose cache fits a budget (a slot's context is a
request's tokens rounded up to llama.cpp's 256 cells).

Slots are llama-server's default for a set count: one stream each. A unified cache (``-kvu``)
packs more requests into the same bytes, but every token then attends over every slot's cells
(masked): 12 unified f16 slots served 27.8 output tokens/s where 10 separate ones served 38.5
(24 clients of 512 + 96 tokens in 180 MB, two runs the same hour on 2 cores).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvmix.runtime.cache import model_spec

PREFIX = "llama.cpp:"  # a row that runs llama.cpp: llama.cpp:TYPE or llama.cpp:K/V


CELL_PAD = 256  # llama_context pads n_ctx to a multiple of 256 cells


# ggml's cache types: (elements per block, bytes per block), ggml.c's type traits.
TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
         "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}


def cache_bytes_per_token(config: Any, k: str, v: str) -> int:
    """Bytes llama.cpp's cache holds per token at these K/V types: ``ggml_row_size`` of each
    side over every layer's ``n_embd_k_gqa``/``n_embd_v_gqa`` (a transformers config)."""
    spec = model_spec(config)
    width = spec.n_kv_heads * spec.head_dim
    return spec.n_layers * sum(_row_bytes(kind, width) for kind in (k, v))


def _row_bytes(kind: str, elements: int) -> int:
    block, size = TYPES[kind]
    return elements // block * size


def parse_types(setting: str) -> tuple[str, str]:
    """``llama.cpp:TYPE`` or ``llama.cpp:K/V`` -> (K type, V type); ValueError naming the valid
    types."""
    kinds = setting.removeprefix(PREFIX).split("/")
    if len(kinds) == 1:
        kinds *= 2
    if len(kinds) != 2 or any(kind not in TYPES for kind in kinds):
        raise ValueError(f"method={setting!r} is invalid; expected llama.cpp:TYPE or "
                         f"llama.cpp:K/V with types {', '.join(TYPES)}")
    return kinds[0], kinds[1]


@dataclass
class SlotFit:
    """llama-server's slots within a budget: ``slots`` streams of ``per_slot`` cells each
    (``-c cells -np slots``, not unified: each slot attends over its own cells only), each
    holding one request of ``per_request`` tokens."""

    k: str
    v: str
    slots: int
    per_request: int
    per_slot: int  # per_request rounded up as llama.cpp rounds n_ctx_seq: to 256 cells
    cells: int
    bytes: int  # the cache llama.cpp allocates: cells x bytes per token


def fit_slots(config: Any, k: str, v: str, budget: int, per_request: int,
              most: int) -> SlotFit:
    """The most slots (at most ``most``) whose cache fits ``budget`` bytes, each slot's context
    rounded up to llama.cpp's 256 cells (``GGML_PAD(n_ctx_seq, 256)``); ValueError when none
    fits."""
    budget, per_token = int(budget), cache_bytes_per_token(config, k, v)
    per_slot = -(-per_request // CELL_PAD) * CELL_PAD
    slots = min(most, budget // (per_slot * per_token))
    if slots < 1:
        raise ValueError(f"memory={budget} bytes fits no llama.cpp slot at {k}/{v}: one request "
                         f"of {per_request} tokens needs a {per_slot * per_token}-byte cache "
                         f"({per_token} bytes per token, {per_slot} cells)")
    return SlotFit(k, v, slots, per_request, per_slot, slots * per_slot,
                    slots * per_slot * per_token)
