"""Admission by bytes (SPEC §11): what one request holds at its longest, by the planner's formula
for this model, and whether a request can ever be served.

The policy is a full reservation: a request is admitted when the bytes it will hold at ``prompt
+ max_new_tokens`` tokens fit the budget beside every running request's reservation, and keeps
them until it ends. A running request therefore never lacks a page, so nothing is evicted,
offloaded or re-prefilled (a re-prefill would change a PN-Mix selection, and the output would
no longer be what ``generate`` gives the prompt alone).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from kvmix.evaluation.planner import kv_bytes
from kvmix.methods import Method
from kvmix.models.catalog import Architecture, from_config


@dataclass
class Budget:
    """The cache bytes a server may hold and the sizes one forward may take."""

    method: Method
    arch: Architecture
    dtype: torch.dtype
    memory: float  # bytes of KV cache: every request's reservation plus the method's static
    max_batch_tokens: int  # tokens of one forward: running requests' new tokens and prompts
    _footprints: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.memory <= self.static:
            raise ValueError(f"memory={self.memory:.0f} bytes does not even hold the method's "
                             f"static tensors ({self.static:.0f} bytes)")
        if not isinstance(self.max_batch_tokens, int) or self.max_batch_tokens < 2:
            raise ValueError(f"max_batch_tokens={self.max_batch_tokens} is invalid; expected an "
                             "integer >= 2")

    @functools.cached_property
    def static(self) -> float:
        """Per-model bytes of the method (transforms, ...), held once."""
        return kv_bytes(self.method, self.arch, 1, 0, self.dtype)["static"]

    def footprint(self, tokens: int) -> float:
        """Bytes one request holds at ``tokens`` tokens (its float slots whole, its pages at the
        method's bits, its selection), the planner's formula."""
        if tokens not in self._footprints:
            parts = kv_bytes(self.method, self.arch, 1, tokens, self.dtype)
            self._footprints[tokens] = sum(parts.values()) - parts["static"]
        return self._footprints[tokens]

    @property
    def max_requests(self) -> int:
        """Requests that can run at once: each holds its float slots at least, and decodes a
        token at every forward (a prompt joins when the tokens left fit it whole)."""
        room = int((self.memory - self.static) // self.footprint(1))
        return max(min(room, self.max_batch_tokens - 1, 1024), 1)

    @functools.cached_property
    def longest(self) -> int:
        """The most tokens one request can reach: the model's positions, or what the budget
        holds for it alone."""
        low, high = 1, self.arch.max_positions or 1 << 24
        while low < high:  # footprints grow with tokens
            middle = (low + high + 1) // 2
            low, high = (middle, high) if self.footprint(middle) <= self.memory - self.static \
                else (low, middle - 1)
        return low

    def fits(self, prompt: int, new_tokens: int) -> int:
        """How many such requests run at once."""
        return int((self.memory - self.static) // self.footprint(prompt + new_tokens))

    def refusal(self, prompt: int, new_tokens: int | None) -> str | None:
        """Why a request of ``prompt`` tokens asking for ``new_tokens`` can never be served, or
        None."""
        if new_tokens is None or new_tokens < 1:
            return f"max_tokens={new_tokens} is invalid; expected an integer >= 1"
        if prompt < 1:
            return "the prompt is empty; expected at least 1 token"
        limit = self.arch.max_positions
        if limit is not None and prompt + new_tokens > limit:
            return (f"the prompt ({prompt} tokens) plus max_tokens={new_tokens} exceeds the "
                    f"model's {limit} positions")
        if prompt > self.max_batch_tokens:
            return (f"the prompt ({prompt} tokens) exceeds max_batch_tokens="
                    f"{self.max_batch_tokens}, the tokens of one forward (a prompt is never "
                    "split)")
        need = self.footprint(prompt + new_tokens)
        if need > self.memory - self.static:
            return (f"the request needs {need / 1e6:.1f} MB of cache at {prompt + new_tokens} "
                    f"tokens, beyond the budget memory={self.memory / 1e6:.1f} MB")
        return None


def model_architecture(model) -> Architecture:
    """The planner's view of a loaded model (its config)."""
    config = model.config.get_text_config(decoder=True)
    return from_config(config.to_dict(), getattr(config, "_name_or_path", "") or "model")
