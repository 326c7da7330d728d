"""Shared fixtures: a tiny random Llama (GQA, 2 layers), the same with the default model's
tokenizer for the serving tests (in memory or saved as a model folder), a folder for every file
Ray writes, and, once per session, the real model."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile

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


def served_llama(tokenizer) -> LlamaForCausalLM:
    """The tiny Llama with the vocabulary and end of sequence of ``tokenizer``."""
    return tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=1024,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=None)


@contextlib.contextmanager
def saved_model(tokenizer):
    """``served_llama`` and its tokenizer saved as a model folder, removed afterwards."""
    folder = tempfile.mkdtemp(prefix="kvmix-model-")
    served_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def ray_files():
    """Every file Ray writes (sessions, sockets, the address of the current cluster) in a
    folder of its own, removed afterwards (short: Ray's socket paths must stay short)."""
    temp = tempfile.mkdtemp(prefix="ray")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    try:
        yield temp
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def real_model():
    from kvmix.models.loading import load_model

    return load_model()
