"""The dataset of the ``kvmix_passkey`` lm-eval task (loaded by lm-eval from this folder)."""

from __future__ import annotations

import random

import datasets
from lm_eval.tasks.ruler.common_utils import get_tokenizer

from kvmix.evaluation.data import load_text
from kvmix.evaluation.needle import build
from kvmix.models.loading import DEFAULT_MODEL, load_tokenizer

DEPTHS = (0.1, 0.5, 0.9)


def dataset(max_seq_lengths=(1024, 2048, 4096), samples: int = 4, seed: int = 0,
            **metadata) -> dict[str, datasets.Dataset]:
    # prompts are sized in tokens: metadata ``tokenizer`` (a folder), else the tokenizer of
    # the model lm-eval's --model_args name (``pretrained``, kvmix's default model if none)
    tokenizer = (get_tokenizer(**metadata) if metadata.get("tokenizer")
                 else load_tokenizer(metadata.get("pretrained") or DEFAULT_MODEL))
    filler = tokenizer(load_text("prose"), add_special_tokens=False).input_ids
    rng, rows = random.Random(seed), []
    for length in max_seq_lengths:
        for depth in DEPTHS:
            for _ in range(samples):
                needle = build(tokenizer, filler, int(length), depth, "passkey", rng)
                # the question ends the prompt; " {answer}" is the scored continuation
                rows.append({"prompt": tokenizer.decode(needle.ids), "answer": needle.answer,
                             "length": int(length), "depth": depth})
    return {"test": datasets.Dataset.from_list(rows)}
