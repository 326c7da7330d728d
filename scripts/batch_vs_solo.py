"""Greedy tokens of a two-row padded batch against each prompt alone, per method, on the
default model (40 tokens; prose prompts of 180 and 120 tokens): the check behind issue 23's
ggml-k8v4 batch finding.

    .venv/bin/python scripts/batch_vs_solo.py ggml-k8v4 ggml:k=q8_0,v=q8_0 kivi2
"""

from __future__ import annotations

import sys

import torch

import kvmix
from kvmix.evaluation.data import load_text
from kvmix.models.loading import load_model

TOKENS = 40


def main(methods: list[str]) -> None:
    loaded = load_model()
    ids = loaded.tokenizer(load_text("prose"), add_special_tokens=False).input_ids
    prompts = [torch.tensor(ids[:180]), torch.tensor(ids[1000:1120])]
    width = max(len(p) for p in prompts)
    batch = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for b, prompt in enumerate(prompts):
        batch[b, width - len(prompt):], mask[b, width - len(prompt):] = prompt, 1
    greedy = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS, "do_sample": False}
    for method in methods:
        runner = kvmix.prepare_model(loaded.model, method)
        with torch.no_grad():
            together = runner.generate(batch, attention_mask=mask,
                                       cache=kvmix.make_cache(runner, method), **greedy)
            for b, prompt in enumerate(prompts):
                alone = runner.generate(prompt[None], cache=kvmix.make_cache(runner, method),
                                        **greedy)[0, len(prompt):]
                same = together[b, width:] == alone
                first = int((~same).nonzero()[0]) if not same.all() else None
                kind = "padded" if len(prompt) < width else "unpadded"
                print(f"{method}: row {b} ({kind}) matches {int(same.sum())}/{TOKENS}, first "
                      f"difference at {first}")


if __name__ == "__main__":
    main(sys.argv[1:] or ["ggml-k8v4"])
