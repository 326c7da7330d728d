"""``kvmix bench``: decode speed of each method, measured side by side in one run.

Prefill a prompt, then time greedy single-token decode steps over each method's cache.
Timings are wall-clock on this machine; they belong here, never in pass/fail tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial

import torch
from rich.progress import Progress

from kvmix.commands.args import add_job_arguments, config_from
from kvmix.evaluation.jobs import JobConfig, finish, load_inputs
from kvmix.evaluation.report import console
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel
from kvmix.runtime.attention import make_cache
from kvmix.runtime.folding import prepare_model

COLUMNS = {"method": "method", "prompt": "prompt", "new_tokens": "new tokens",
           "tokens_per_s": "tokens/s", "ms_per_token": "ms/token", "nbytes": "cache bytes"}


@dataclass
class BenchConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2"])
    prompt: int = 1024
    new_tokens: int = 64
    warmup: int = 4


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="decode tokens/s of each method after a prompt")
    add_job_arguments(parser, BenchConfig())
    parser.add_argument("--prompt", type=int, default=BenchConfig.prompt, help="prompt tokens")
    parser.add_argument("--new-tokens", type=int, default=BenchConfig.new_tokens,
                        help="timed greedy decode steps")
    parser.set_defaults(run=lambda args: run_bench(config_from(BenchConfig, args)))


def run_bench(config: BenchConfig, loaded: LoadedModel | None = None) -> list[dict]:
    for name in ("prompt", "new_tokens"):
        if getattr(config, name) < 1:
            raise ValueError(f"{name}={getattr(config, name)} is invalid; expected >= 1")
    for method in config.methods:
        parse_method(method)
    loaded, ids = load_inputs(config, config.prompt, loaded)
    rows = []
    with Progress(console=console, transient=True) as bar:
        for method in config.methods:
            task = bar.add_task(method, total=config.warmup + config.new_tokens)
            tick = partial(bar.advance, task)
            rows.append(_decode_speed(loaded, ids, method, config, tick))
    finish("bench", config, loaded, rows, f"{config.device} · prompt {config.prompt}", COLUMNS,
           device=str(loaded.model.device))
    return rows


@torch.no_grad()
def _decode_speed(loaded: LoadedModel, ids: torch.Tensor, method: str, config: BenchConfig,
                  tick) -> dict:
    model = prepare_model(loaded.model, method)
    cache = make_cache(model, method)
    logits = model(ids.to(model.device), cache=cache, use_cache=True).logits
    token = logits[:, -1:].argmax(-1)  # [1, 1]
    for step in range(config.warmup + config.new_tokens):
        if step == config.warmup:
            _sync(model.device)
            start = time.perf_counter()
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tick()
    _sync(model.device)
    seconds = time.perf_counter() - start
    return {"method": method, "prompt": config.prompt, "new_tokens": config.new_tokens,
            "tokens_per_s": config.new_tokens / seconds,
            "ms_per_token": 1000 * seconds / config.new_tokens, "nbytes": cache.nbytes()}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
