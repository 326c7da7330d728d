"""kvmix's batch-1 llama.cpp rows (``kvmix bench``): a model's GGUF decoded token by token
through llama.cpp's Python bindings, at the cache types a row names."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvmix.engines.llamacpp.build import bindings
from kvmix.engines.llamacpp.slots import cache_bytes_per_token

GGML_TYPE_BF16 = 30  # ggml.h


def ggml_type(name: str) -> int:
    """The bindings' ``GGML_TYPE_*`` number of a cache type (bf16: ggml.h's, which
    llama-cpp-python 0.3.36 does not export)."""
    return GGML_TYPE_BF16 if name == "bf16" else getattr(bindings(), f"GGML_TYPE_{name.upper()}")


class Decoder:
    """llama.cpp's batch-1 decode through the Python bindings, called as ``kvmix bench`` calls a
    model: ``decoder(ids [1, T]) -> .logits [1, 1, V]`` (the last position) with the context of
    ``context`` tokens as its cache; ``nbytes()`` is the cache llama.cpp allocates for it."""

    device = torch.device("cpu")

    def __init__(self, gguf: Path, config: Any, k: str, v: str, context: int, threads: int):
        self.llm = bindings().Llama(
            model_path=str(gguf), n_ctx=context, n_batch=512, n_ubatch=512, flash_attn=True,
            type_k=ggml_type(k), type_v=ggml_type(v), n_threads=threads,
            n_threads_batch=threads, verbose=False)
        self.cache_bytes = self.llm.n_ctx() * cache_bytes_per_token(config, k, v)

    def __call__(self, ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        self.llm.eval(ids[0].tolist())
        last = bindings().llama_get_logits_ith(self.llm.ctx, -1)  # the batch's last row
        logits = np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),)).copy()
        return SimpleNamespace(logits=torch.from_numpy(logits)[None, None])  # [1, 1, V]

    def nbytes(self) -> int:
        return self.cache_bytes
