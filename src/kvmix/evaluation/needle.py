"""Synthetic retrieval at length (passkey and key-value needle in a haystack), generated from a
seed: filler tokens from offline text, a random five-digit number hidden at a relative depth, a
question at the end, and exact match of the greedy answer's first number."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

from kvmix.runtime.attention import make_cache
from kvmix.runtime.folding import prepare_model

KINDS = ("passkey", "kv")
WORDS = ("apple", "river", "candle", "marble", "violet", "harbor", "pepper", "lantern",
         "meadow", "copper", "falcon", "saddle", "thistle", "quartz", "orchid", "walnut")
ANSWER_TOKENS = 8


@dataclass
class Needle:
    """One retrieval prompt: token ids and the number the model should answer."""

    ids: list[int]
    answer: str


def texts(kind: str, number: int, word: str) -> tuple[str, str, str]:
    """(instruction, needle, question) of a ``kind`` prompt."""
    if kind == "passkey":
        return ("There is a pass key hidden inside a lot of irrelevant text. Find it and "
                "memorize it. I will quiz you about the pass key.\n",
                f"\nThe pass key is {number}. Remember it. {number} is the pass key.\n",
                "\nWhat is the pass key? The pass key is")
    return ("Some special magic numbers are hidden within the following text. Make sure to "
            "memorize them. I will quiz you about the numbers afterwards.\n",
            f"\nOne of the special magic numbers for {word} is: {number}.\n",
            f"\nWhat is the special magic number for {word}? The special magic number for "
            f"{word} is:")


def overhead(tokenizer, kind: str) -> int:
    """Tokens a prompt spends outside the filler (the longest a number can make them)."""
    return sum(len(tokenizer(t, add_special_tokens=False).input_ids)
               for t in texts(kind, 99999, max(WORDS, key=len)))


def build(tokenizer, filler: list[int], length: int, depth: float, kind: str,
          rng: random.Random) -> Needle:
    """A ``length``-token prompt with the needle at ``depth`` (0 = first, 1 = last) of the
    filler; the filler starts at a random offset of ``filler``."""
    number, word = rng.randrange(10_000, 100_000), rng.choice(WORDS)
    intro, needle, question = (tokenizer(t, add_special_tokens=False).input_ids
                               for t in texts(kind, number, word))
    room = length - len(intro) - len(needle) - len(question)
    start = rng.randrange(0, len(filler) - room)
    hay = filler[start : start + room]
    cut = round(depth * room)
    return Needle(intro + hay[:cut] + needle + hay[cut:] + question, str(number))


@torch.no_grad()
def answers(model, tokenizer, method: str, needles: list[Needle], pad: int,
            backend: str = "auto") -> list[str]:
    """Greedy answers (decoded text) of equal-length prompts, batched, through ``method``."""
    runner = prepare_model(model, method)
    ids = torch.tensor([n.ids for n in needles], device=runner.device)  # [B, T]
    out = runner.generate(ids, attention_mask=torch.ones_like(ids),
                          cache=make_cache(runner, method, backend), do_sample=False,
                          max_new_tokens=ANSWER_TOKENS, eos_token_id=None, pad_token_id=pad)
    return [tokenizer.decode(row) for row in out[:, ids.shape[1]:]]


def correct(answer: str, expected: str) -> bool:
    """The answer's first number is the expected one."""
    found = re.search(r"\d+", answer)
    return bool(found) and found.group() == expected
