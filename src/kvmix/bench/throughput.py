"""Aggregate decode throughput of many sequences at once (``kvmix bench --throughput``): the
the papers' efficiency claim — more sequences fit a fixed memory, so more tokens per second.

For every cache (transformers' ``DynamicCache`` and ``QuantizedCache``, kvmix methods):

1. **bytes per sequence** at ``prompt + tokens`` tokens, measured: one sequence of that length
   prefilled (teacher-forced) into a fresh cache, then the cache's bytes (kvmix's ``nbytes()``
   with its pool sized up front; the storages reachable from transformers' caches). kvmix rows
   also carry the planner's figure for the same length (``planned_bytes``);
2. **the largest batch** whose caches fit ``memory`` at that length: the budget over the bytes
   per sequence; the run at that batch confirms it (``cache_bytes`` measured after its steps,
   kvmix's pool sized for ``prompt + tokens`` per sequence so a batch that did not fit would
   be refused);
3. **aggregate greedy decode tokens/s** at each fixed ``batch`` (every cache, rounds
   interleaved) and at each cache's own largest batch (the caches interleaved again), each
   sequence its own window of the text. ``peak_bytes``: the most in use while decoding above
   what was in use before the cache was made (the CUDA allocator's on a GPU, the process heap
   on CPU): the cache plus what a step materialises. ``vs_dynamic``: over DynamicCache at the
   same batch; at the budget, over DynamicCache at *its* largest batch — equal memory.

Timings are wall-clock measurements of this machine, never test verdicts.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvmix.bench.resources import PeakMemory, heap_bytes, synchronize
from kvmix.capacity import kv_bytes
from kvmix.core.memory import reachable_bytes
from kvmix.models.catalog import from_config
from kvmix.runtime.attention import make_cache
from kvmix.runtime.baselines import transformers_cache
from kvmix.runtime.folding import prepare_model


@dataclass
class Cache:
    """One cache under test: ``make(model, batch, tokens)`` -> (the model to run, a cache)."""

    name: str
    backend: str
    make: Callable[[Any, int, int], tuple[Any, Any]]
    per_sequence: int = 0
    planned: float | None = None
    max_batch: int = 0


@dataclass
class Run:
    """One cache at one batch, alive across the timing rounds."""

    candidate: Cache
    group: str  # "batch" (a fixed batch) or "budget" (the cache's largest batch)
    batch: int
    model: Any
    cache: Any
    token: torch.Tensor  # [B, 1]
    prefill_s: float
    base_bytes: int
    seconds: list[float] = field(default_factory=list)
    peak: int = 0


def kvmix_cache(method: str, backend: str) -> Cache:
    def make(model, batch: int, tokens: int):
        runner = prepare_model(model, method)
        return runner, make_cache(runner, method, backend, max_batch=batch, max_tokens=tokens)
    return Cache(method, backend, make)


def baseline_cache(name: str) -> Cache:
    def make(model, batch: int, tokens: int):
        make_cache(model, "full")  # kvmix's attention function: plain SDPA for other caches
        return model, transformers_cache(name, model)
    return Cache(name, "-", make)


def cache_bytes(state: Any) -> int:
    return state.nbytes() if hasattr(state, "nbytes") else reachable_bytes(state)


@torch.no_grad()
def measure_sizes(model, caches: list[Cache], windows: torch.Tensor, tokens: int,
                  memory: float) -> None:
    """Bytes per sequence at ``tokens`` tokens (one prefill each) and the largest batch."""
    arch = from_config(model.config.to_dict(), "model")
    for cache in caches:
        runner, state = cache.make(model, 1, tokens)
        runner(windows[:1, :tokens].to(runner.device), cache=state, use_cache=True,
               logits_to_keep=1)
        cache.per_sequence = cache_bytes(state)
        if cache.backend != "-":
            method = state.method
            cache.planned = sum(kv_bytes(method, arch, 1, tokens, state.packed_layers[0].dtype)
                                .values())
        cache.max_batch = int(memory // cache.per_sequence)
        del runner, state
        gc.collect()


def windows(ids: torch.Tensor, rows: int, prompt: int) -> torch.Tensor:
    """``rows`` windows of ``prompt`` tokens from ids [1, N]: distinct where the text allows,
    then wrapping around -> [rows, prompt]."""
    room = ids.shape[1] - prompt
    starts = [(row * prompt) % max(room, 1) for row in range(rows)]
    return torch.stack([ids[0, s : s + prompt] for s in starts])


@torch.no_grad()
def start(model, candidate: Cache, group: str, batch: int, prompts: torch.Tensor, tokens: int,
          warmup: int) -> Run:
    """Make the cache, prefill ``prompts`` [batch, prompt] (timed), warm up."""
    gc.collect()
    base = _allocated(model.device)
    runner, cache = candidate.make(model, batch, tokens)
    began = time.perf_counter()
    logits = runner(prompts.to(runner.device), cache=cache, use_cache=True,
                    logits_to_keep=1).logits
    synchronize(runner.device)
    prefill = time.perf_counter() - began
    token = logits[:, -1:].argmax(-1)  # [B, 1]
    for _ in range(warmup):
        token = step(runner, cache, token)
    return Run(candidate, group, batch, runner, cache, token, prefill, base)


@torch.no_grad()
def timed(run: Any, steps: int) -> None:
    """``steps`` greedy decode steps of the whole batch, timed (nothing else runs: memory has
    its own round); ``run`` has the model, its cache, the next token and a list of seconds
    per step (``bench``'s prompt runs too)."""
    synchronize(run.model.device)
    began = time.perf_counter()
    for _ in range(steps):
        run.token = step(run.model, run.cache, run.token)
    synchronize(run.model.device)
    run.seconds.append((time.perf_counter() - began) / steps)


@torch.no_grad()
def measure_peak(run: Run, steps: int) -> None:
    """``steps`` untimed decode steps with the allocator sampled: the peak above what was in
    use before the cache was made."""
    device = run.model.device
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    with PeakMemory() as memory:
        for _ in range(steps):
            run.token = step(run.model, run.cache, run.token)
        synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else memory.peak
    run.peak = max(run.peak, peak - run.base_bytes)


def rows(runs: list[Run], prompt: int) -> list[dict]:
    """One row per run, with tokens/s against DynamicCache's in the same group."""
    out = []
    for run in runs:
        rate = run.batch / statistics.median(run.seconds)
        candidate = run.candidate
        out.append({"method": candidate.name, "backend": candidate.backend, "group": run.group,
                    "batch": run.batch, "prompt": prompt, "tokens_per_s": rate,
                    "max_batch": candidate.max_batch, "per_sequence_bytes":
                    candidate.per_sequence, "planned_bytes": candidate.planned,
                    "cache_bytes": cache_bytes(run.cache), "peak_bytes": run.peak,
                    "prefill_s": run.prefill_s})
    for row in out:
        dynamic = [r for r in out if r["method"] == "dynamic" and r["group"] == row["group"]
                   and (row["group"] == "budget" or r["batch"] == row["batch"])]
        row["vs_dynamic"] = row["tokens_per_s"] / dynamic[0]["tokens_per_s"] if dynamic else None
    return out


def step(model, cache, token: torch.Tensor) -> torch.Tensor:
    """One greedy decode step of every sequence: token [B, 1] -> the next [B, 1]."""
    return model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)


def _allocated(device: torch.device) -> int:
    """Bytes in use on ``device``: the CUDA allocator's, or the process heap's."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else heap_bytes()
