"""Shared fixtures: a tiny random Llama (GQA, 2 layers) and, once per session, the real model."""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; it is chosen when the
# kernels are defined, so before kvmix is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM

TINY = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 512, "pad_token_id": 0}


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama()


@pytest.fixture(scope="session")
def real_model():
    from kvmix.models.loading import load_model

    return load_model()
