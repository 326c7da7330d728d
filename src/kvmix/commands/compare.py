"""``kvmix compare``, the main job: memory, perplexity, token KL and time of each method, with
``--out`` a plot of cache megabytes against token KL (``compare.png``). The table shows bytes in
MB (10^6 bytes); results.json keeps each row's bytes as integers beside them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmix.commands.args import (
    add_grid_arguments,
    add_job_arguments,
    add_length_arguments,
    config_from,
)
from kvmix.engines.vllm import scoring as vllm_scoring
from kvmix.engines.vllm.server import DEFAULT_PYTHON
from kvmix.evaluation.inputs import JobConfig, check_inputs, load_inputs
from kvmix.evaluation.scoring import Scored, check_lengths, score, scored_inputs, summary
from kvmix.jobs.grid import Grid, GridConfig, Worker, check_grid, merged
from kvmix.jobs.plots import plt
from kvmix.jobs.report import console, finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

DEFAULT_METHODS = ("full", "kivi2", "kivi4", "kxvy:key_bits=4,value_bits=2",
                   "kxvy:key_bits=2,value_bits=4", "pnmix1")
COLUMNS = {"method": "method", "key_bits": "K bits", "value_bits": "V bits",
           "cache_mb": "cache MB", "ratio_fp16": "/16-bit", "cache_16bit_mb": "MB@16",
           "effective_bits": "eff. bits", "static_mb": "static MB", "ppl": "ppl",
           "delta_ppl": "Δppl", "token_kl": "token KL", "seconds": "time s"}
MEGABYTES = {"nbytes": "cache_mb", "nbytes_16bit": "cache_16bit_mb", "static": "static_mb"}
ENGINES = ("kvmix", "vllm")
VLLM_PREFILLS = ("exact", "decode")  # the plugin's PREFILLS (kvmix.vllm: imported by vLLM only)
VLLM_COLUMNS = {"method": "method", "ppl": "ppl (kvmix)", "delta_ppl": "Δppl (kvmix)",
                "vllm_ppl": "ppl (vLLM)", "vllm_delta_ppl": "Δppl (vLLM)",
                "delta_ratio": "Δ vLLM/kvmix", "vllm_seconds": "vLLM s"}


@dataclass
class CompareConfig(GridConfig, JobConfig):
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    context: int = 1024
    eval_tokens: int = 256
    chunk: int = 1
    engine: str = "kvmix"  # vllm: also through vLLM, each method with vLLM's layout
    vllm_python: str = DEFAULT_PYTHON
    vllm_prefill: str = "exact"  # the plugin's prefill (kvmix.runtime.plugin_settings.PREFILLS)


def add_parser(commands) -> None:
    parser = commands.add_parser("compare", help="memory, perplexity, token KL and time per method")
    add_job_arguments(parser, CompareConfig())
    add_length_arguments(parser, CompareConfig)
    add_grid_arguments(parser)
    parser.add_argument("--engine", default="kvmix", help="kvmix, or vllm: every method also "
                        "through vLLM (kvmix's plugin; sink=0, residual=group on both paths)")
    parser.add_argument("--vllm-python", default=DEFAULT_PYTHON,
                        help="the vLLM environment's interpreter (make vllm builds it)")
    parser.add_argument("--vllm-prefill", default="exact",
                        help="the plugin's prefill: exact (the context a float prefill, as "
                        "kvmix scores it) or decode (every prompt token attends as a decode)")
    parser.set_defaults(run=lambda args: run_compare(config_from(CompareConfig, args)))


def run_compare(config: CompareConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """Evaluate every method on the same tokens against the ``full`` cache: one cell per
    method (``jobs.grid``: here or on Ray, resumed from ``--out``)."""
    check_lengths(config.context, config.eval_tokens, config.chunk)
    check_inputs(config)
    check_grid(config)
    if config.engine not in ENGINES:
        raise ValueError(f"engine={config.engine!r} is invalid; valid: {', '.join(ENGINES)}")
    for method in config.methods:  # bad method strings fail before loading
        if config.engine == "vllm":
            vllm_scoring.check_setting(method)
        else:
            parse_method(method)
    if config.vllm_prefill not in VLLM_PREFILLS:
        raise ValueError(f"vllm_prefill={config.vllm_prefill!r} is invalid; valid: "
                         f"{', '.join(VLLM_PREFILLS)}")
    if config.engine == "vllm":
        return _through_vllm(config, loaded)
    grid = Grid("compare", config, compare_cell, shared=config)
    outcomes, model = grid.run(list(config.methods), Worker.holding(loaded, config))
    rows = [_megabytes(row) for row in merged(outcomes)]  # resumed cells' rows too
    for row in rows:
        if row["plan"]:
            console.print(f"{row['method']} plan: key bits {row['plan']['key_bits']}, "
                          f"value bits {row['plan']['value_bits']}")
    plots = [str(_plot(config, rows, model["name"]))] if config.out and rows else []
    finish("compare", config, model, rows, f"{config.data} · context {config.context} + "
           f"{config.eval_tokens} tokens", COLUMNS, plots=plots)
    return rows


def compare_cell(worker: Worker, config: CompareConfig, method: str) -> list[dict]:
    """One method scored on the config's tokens against ``full`` (once per worker)."""
    loaded, ids, full = scored_inputs(worker, config)
    scored = full if method == "full" else score(loaded.model, ids, method, config.context,
                                                  config.chunk, backend=config.backend)
    return [_row(method, parse_method(method), scored, full, loaded.dtype)]


def _megabytes(row: dict) -> dict:
    """``row`` with its byte counts also in MB (10^6 bytes), as the table shows them."""
    return row | {mb: row[key] / 1e6 for key, mb in MEGABYTES.items() if key in row}


def _plot(config: CompareConfig, rows: list[dict], model: str) -> Path:
    """Cache MB against token KL, one point per method named in the legend (methods of about
    the same size would hide each other's labels); the KL axis is logarithmic (linear below the
    smallest nonzero KL, where ``full``'s 0 lies) when it spans over 100×."""
    Path(config.out).mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(figsize=(9, 4.5))
    for row, marker in zip(rows, itertools.cycle("osD^vP*X"), strict=False):
        axes.plot(row["cache_mb"], row["token_kl"], marker=marker, markersize=8, linestyle="",
                  label=row["method"])
    kls = [row["token_kl"] for row in rows if row["token_kl"] > 0]
    log = bool(kls) and max(kls) > 100 * min(kls)
    if log:
        axes.set_yscale("symlog", linthresh=min(kls))
    axes.set(xlabel="KV cache (MB)", ylabel="token KL vs full" + (" (log)" if log else ""),
             title=f"{model} · {config.data} · context {config.context} + "
                   f"{config.eval_tokens} tokens")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    figure.tight_layout()
    figure.savefig(Path(config.out) / "compare.png", dpi=120)
    plt.close(figure)
    return Path(config.out) / "compare.png"


def _row(text: str, method, scored: Scored, full: Scored, dtype: torch.dtype) -> dict:
    return {"method": text, "resolved": repr(method), **summary(scored, full),
            "nbytes_theoretical": scored.theoretical_nbytes,
            "nbytes_breakdown": scored.nbytes_breakdown,
            "nbytes_dtype": scored.nbytes_fp16 * dtype.itemsize // 2,
            "ratio_dtype": scored.nbytes / (scored.nbytes_fp16 * dtype.itemsize / 2),
            "plan": scored.plan}


def _through_vllm(config: CompareConfig, loaded: LoadedModel | None) -> list[dict]:
    """Each method with vLLM's layout, scored through kvmix's path and through vLLM on the
    same tokens: perplexity and its change from each engine's own float cache."""
    vllm_scoring.check_python(config.vllm_python)
    methods = list(dict.fromkeys(["full", *map(vllm_scoring.vllm_layout, config.methods)]))
    loaded, ids = load_inputs(config, config.context + config.eval_tokens + 1, loaded)
    scored = {name: score(loaded.model, ids, name, config.context, config.chunk,
                          backend=config.backend)
              for name in dict.fromkeys(map(vllm_scoring.own_method, methods))}
    own = {m: scored[vllm_scoring.own_method(m)] for m in methods}  # kvmix's own path
    console.print(f"scoring {len(methods)} methods through vLLM ({config.vllm_python})")
    engine = vllm_scoring.score(config.vllm_python, loaded, ids, config.context, methods,
                                config.vllm_prefill)
    rows = [_vllm_row(m, own[m], own["full"], engine[m], engine["full"]) for m in methods]
    finish("compare", config, loaded, rows, f"{config.data} · context {config.context} + "
           f"{config.eval_tokens} tokens · kvmix and vLLM", VLLM_COLUMNS)
    return rows


def _vllm_row(method: str, scored: Scored, full: Scored, engine: dict, engine_full: dict
              ) -> dict:
    row = {"method": method, "resolved": repr(parse_method(vllm_scoring.own_method(method))),
           **summary(scored, full),
           "vllm_ppl": engine["ppl"], "vllm_delta_ppl": engine["ppl"] - engine_full["ppl"],
           "vllm_seconds": engine["seconds"], "vllm_block_size": engine["block_size"]}
    if method != "full":
        row["delta_ratio"] = row["vllm_delta_ppl"] / row["delta_ppl"]
    return row
