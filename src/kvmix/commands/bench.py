"""``kvmix bench``: decode speed and memory of each method beside the caches users would pick
instead, measured side by side in one run.

For every prompt length: prefill, then time greedy single-token decode steps over each cache:
transformers' ``DynamicCache`` (``dynamic``) and ``QuantizedCache`` (``quanto2``, ``quanto4``,
``hqq2``, ``hqq4``), then every kvmix method on every backend. ``vs_dynamic`` is tokens/s over
DynamicCache's at the same prompt in the same run. Memory is the allocator's bytes in use
(``kvmix.evaluation.resources``) above those in use just before the cache was made:
``peak_bytes`` during decode and ``steady_bytes`` after it (the cache still held); ``nbytes`` is
what the cache itself reports (for transformers' caches, the storages reachable from them).
``select_s`` is the prefill time spent in channel selection (PN-Mix, Kitty, ChanMix).
Timings are wall-clock on this machine; they belong here, never in pass/fail tests.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from kvmix.commands.args import add_job_arguments, config_from
from kvmix.core.memory import reachable_bytes
from kvmix.evaluation.jobs import JobConfig, finish, load_inputs
from kvmix.evaluation.plots import scatter_lines
from kvmix.evaluation.report import console
from kvmix.evaluation.resources import PeakMemory, heap_bytes
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel
from kvmix.runtime.attention import make_cache
from kvmix.runtime.baselines import BASELINES, transformers_cache
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.kernels import BACKENDS, resolve

COLUMNS = {"method": "method", "backend": "backend", "prompt": "prompt",
           "prefill_s": "prefill s", "select_s": "select s", "tokens_per_s": "tokens/s",
           "vs_dynamic": "vs dynamic", "ms_per_token": "ms/token", "nbytes": "cache bytes",
           "peak_bytes": "peak Δ", "steady_bytes": "steady Δ"}


@dataclass
class BenchConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2"])
    baselines: list[str] = field(default_factory=lambda: ["dynamic"])
    prompt: list[int] = field(default_factory=lambda: [1024])
    new_tokens: int = 32
    warmup: int = 4
    backend: list[str] = field(default_factory=lambda: ["auto"])


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="decode speed and memory vs transformers' caches")
    add_job_arguments(parser, BenchConfig())
    parser.add_argument("--baselines", default="dynamic",
                        help=f"transformers caches to run beside ({', '.join(BASELINES)}; "
                             "'' for none)")
    parser.add_argument("--prompt", default="1024", help="prompt lengths, e.g. 1024,7680")
    parser.add_argument("--new-tokens", type=int, default=BenchConfig.new_tokens,
                        help="timed greedy decode steps")
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup)
    parser.add_argument("--backend", default="auto",
                        help=f"kvmix backends to run, e.g. torch,cpu ({', '.join(BACKENDS)})")
    parser.set_defaults(run=lambda args: run_bench(config_from(BenchConfig, args)))


def run_bench(config: BenchConfig, loaded: LoadedModel | None = None) -> list[dict]:
    _check(config)
    loaded, ids = load_inputs(config, max(config.prompt), loaded)
    backends = list(dict.fromkeys(resolve(b, loaded.model.device) for b in config.backend))
    runs = [(b, "-", partial(_baseline, b)) for b in config.baselines]
    runs += [(m, b, partial(_kvmix, m, b)) for m in config.methods for b in backends]
    rows = []
    with Progress(console=console, transient=True) as bar:
        for prompt in config.prompt:
            for name, backend, build in runs:
                task = bar.add_task(f"{name} {backend} @{prompt}",
                                    total=config.warmup + config.new_tokens)
                row = _measure(loaded.model, ids[:, :prompt], build, config,
                               partial(bar.advance, task))
                rows.append({"method": name, "backend": backend, "prompt": prompt, **row})
    _ratios(rows)
    plots = [str(_plot(config, rows))] if config.out else []
    finish("bench", config, loaded, rows, f"{loaded.model.device} · {config.new_tokens} decode "
           f"steps · {torch.get_num_threads()} threads", COLUMNS, device=str(loaded.model.device),
           threads=torch.get_num_threads(), plots=plots)
    return rows


def _check(config: BenchConfig) -> None:
    """Bad input fails before the model loads."""
    for name in ("new_tokens", "warmup"):
        if getattr(config, name) < (1 if name == "new_tokens" else 0):
            raise ValueError(f"{name}={getattr(config, name)} is invalid; expected >= 1")
    if not config.prompt or min(config.prompt) < 1:
        raise ValueError(f"prompt={config.prompt} is invalid; expected lengths >= 1")
    unknown = sorted(set(config.baselines) - set(BASELINES))
    if unknown:
        raise ValueError(f"baselines {unknown} are unknown; valid: {', '.join(BASELINES)}")
    for backend in config.backend:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is invalid; valid: {', '.join(BACKENDS)}")
    for method in config.methods:
        parse_method(method)


@torch.no_grad()
def _measure(model, ids: torch.Tensor, build: Callable, config: BenchConfig, tick) -> dict:
    """Prefill ``ids`` [1, T], then warm up and time greedy single-token decode steps."""
    gc.collect()
    base = heap_bytes()
    runner, cache, selecting = build(model)
    start = time.perf_counter()
    logits = runner(ids.to(runner.device), cache=cache, use_cache=True).logits
    _sync(runner.device)
    prefill = time.perf_counter() - start
    token = logits[:, -1:].argmax(-1)  # [1, 1]
    del logits
    for _ in range(config.warmup):
        token = _step(runner, cache, token, tick)
    with PeakMemory() as memory:
        _sync(runner.device)
        start = time.perf_counter()
        for _ in range(config.new_tokens):
            token = _step(runner, cache, token, tick)
        _sync(runner.device)
        seconds = time.perf_counter() - start
    gc.collect()
    return {"prefill_s": prefill, "select_s": selecting[0],
            "tokens_per_s": config.new_tokens / seconds,
            "ms_per_token": 1000 * seconds / config.new_tokens, "nbytes": _nbytes(cache),
            "peak_bytes": memory.peak - base, "steady_bytes": heap_bytes() - base}


def _step(model, cache, token: torch.Tensor, tick) -> torch.Tensor:
    """One greedy decode step: token [1, 1] -> the next [1, 1]."""
    token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    tick()
    return token


def _kvmix(method: str, backend: str, model) -> tuple[Any, Any, list[float]]:
    runner = prepare_model(model, method)
    cache = make_cache(runner, method, backend=backend)
    return runner, cache, _time_selection(cache.method)


def _baseline(name: str, model) -> tuple[Any, Any, list[float]]:
    make_cache(model, "full")  # route through kvmix attention: plain SDPA for other caches
    return model, transformers_cache(name, model), [0.0]


def _time_selection(method) -> list[float]:
    """Wrap the method's prefill-time selection with a stopwatch: [seconds] accumulates."""
    spent = [0.0]
    select = method.select

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return select(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    method.select = timed
    return spent


def _nbytes(cache) -> int | None:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    try:
        return reachable_bytes(cache)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without plain storage
        return None


def _ratios(rows: list[dict]) -> None:
    dynamic = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "dynamic"}
    for row in rows:
        reference = dynamic.get(row["prompt"])
        row["vs_dynamic"] = row["tokens_per_s"] / reference if reference else None


def _plot(config: BenchConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        label = row["method"] if row["backend"] == "-" else f"{row['method']} ({row['backend']})"
        series.setdefault(label, []).append((row["prompt"], row["ms_per_token"]))
    return scatter_lines(Path(config.out) / "decode.png", series, "prompt tokens",
                         "ms per decode step", "decode latency vs context")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
