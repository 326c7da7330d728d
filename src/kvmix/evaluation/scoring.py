"""Evaluation through the cache (docs/guide/evaluation.md).

A single forward pass never reads the cache, so perplexity is measured by prefilling a context
and then scoring the following tokens by teacher-forced decoding in chunks, each chunk attending
to the (quantized) cache. Token KL compares, position by position, the next-token distributions
of a method with those of the ``full`` cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich.progress import Progress

from kvmix.evaluation.inputs import load_inputs
from kvmix.jobs.report import console
from kvmix.methods import Method
from kvmix.models.loading import LoadedModel
from kvmix.runtime.attention import make_cache
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.folding import prepare_model


@dataclass
class Scored:
    """Next-token log-probabilities of the evaluated positions and what the cache held after."""

    logprobs: torch.Tensor  # [N, V] float32
    targets: torch.Tensor  # [N]
    seconds: float
    nbytes: int
    nbytes_breakdown: dict[str, int] = field(default_factory=dict)
    theoretical_nbytes: float = 0.0
    nbytes_fp16: int = 0
    nbytes_16bit: int = 0  # as held, with sink and residual priced at 16 bits
    bits: tuple[float, float] = (0.0, 0.0)  # key, value bits per stored element
    plan: dict | None = None  # per-layer widths a budget-mode method chose

    @property
    def nll(self) -> float:
        return -self.logprobs.gather(1, self.targets[:, None]).mean().item()

    @property
    def ppl(self) -> float:
        return float(torch.tensor(self.nll).exp())


def check_lengths(context: int, eval_tokens: int, chunk: int) -> None:
    for name, value in (("context", context), ("eval_tokens", eval_tokens), ("chunk", chunk)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 1")


@torch.no_grad()
def score(model, ids: torch.Tensor, method: str | Method, context: int, chunk: int = 1,
          progress: Callable[[int], None] | None = None, backend: str = "auto") -> Scored:
    """Prefill ``ids[:, :context]``, then decode the rest in chunks over the method's cache.

    ids: [1, context + N + 1]; scores the N tokens after the first decoded one, whose logits all
    come from attention over the cache (the prefill's own last logit never reads it).
    """
    check_lengths(context, ids.shape[1] - context - 1, chunk)
    ids = ids.to(model.device)
    model = prepare_model(model, method)  # a folded copy for methods that fold into weights
    cache = make_cache(model, method, backend)
    start = time.perf_counter()
    model(ids[:, :context], cache=cache, use_cache=True, logits_to_keep=1)  # logits unused
    logprobs = []
    for begin in range(context, ids.shape[1] - 1, chunk):
        piece = ids[:, begin : min(begin + chunk, ids.shape[1] - 1)]  # [1, c]
        logits = model(piece, cache=cache, use_cache=True).logits[0]  # [c, V]
        logprobs.append(torch.log_softmax(logits.float(), dim=-1))
        if progress:
            progress(piece.shape[1])
    seconds = time.perf_counter() - start
    return _scored(cache, torch.cat(logprobs), ids[0, context + 1 :], seconds)


def _scored(cache: KVMixCache, logprobs: torch.Tensor, targets: torch.Tensor,
            seconds: float) -> Scored:
    """What the cache held for its tokens (capacity reserved ahead is in the breakdown as
    ``free``, apart)."""
    reserved = cache.nbytes_breakdown().get("free", 0)
    return Scored(logprobs.cpu(), targets.cpu(), seconds, cache.held_nbytes(),
                  cache.nbytes_breakdown(), cache.theoretical_nbytes() - reserved,
                  cache.fp16_nbytes(), cache.nbytes_16bit(), cache.bits(),
                  getattr(cache.method, "plan", None))


def token_kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    """Mean over positions of KL(reference ‖ other); both [N, V] log-probabilities."""
    return (reference.exp() * (reference - other)).sum(-1).mean().item()


def summary(scored: Scored, full: Scored) -> dict:
    """The figures every report gives for one method, measured against the ``full`` cache.

    ``nbytes`` is what the cache holds; ``static`` the per-model part of it (transforms);
    ``nbytes_16bit`` the same cache with sink and residual at 16 bits (a 16-bit model);
    ``effective_bits`` bits per cached element of that, sink, residual and masks included,
    static excluded."""
    static = scored.nbytes_breakdown.get("static", 0)
    return {"key_bits": scored.bits[0], "value_bits": scored.bits[1], "nbytes": scored.nbytes,
            "static": static, "nbytes_fp16": scored.nbytes_fp16,
            "ratio_fp16": scored.nbytes / scored.nbytes_fp16,
            "nbytes_16bit": scored.nbytes_16bit,
            "effective_bits": 16 * (scored.nbytes_16bit - static) / scored.nbytes_fp16,
            "ppl": scored.ppl, "delta_ppl": scored.ppl - full.ppl,
            "token_kl": token_kl(full.logprobs, scored.logprobs), "seconds": scored.seconds}


def score_methods(loaded: LoadedModel, ids: torch.Tensor, methods: list[str], context: int,
                  chunk: int, backend: str = "auto") -> dict[str, Scored]:
    """Score each distinct method string once, in order, over the same tokens."""
    for method in dict.fromkeys(methods):  # every method binds to the model before any work
        make_cache(prepare_model(loaded.model, method), method, backend)
    results: dict[str, Scored] = {}
    with Progress(console=console, transient=True) as bar:
        for method in dict.fromkeys(methods):
            task = bar.add_task(method, total=ids.shape[1] - context - 1)
            results[method] = score(loaded.model, ids, method, context, chunk,
                                    progress=lambda n, t=task: bar.advance(t, n),
                                    backend=backend)
    return results


def scored_inputs(worker: Any, config: Any) -> tuple[LoadedModel, torch.Tensor, Scored]:
    """A grid worker's model, the config's ``context + eval_tokens + 1`` tokens [1, n] and the
    ``full`` cache's scores of them (what every method is measured against), made once per
    worker."""
    loaded = worker.loaded
    ids = worker.memo("ids", lambda: load_inputs(
        config, config.context + config.eval_tokens + 1, loaded)[1])
    full = worker.memo("full", lambda: score(loaded.model, ids, "full", config.context,
                                             config.chunk, backend=config.backend))
    return loaded, ids, full
