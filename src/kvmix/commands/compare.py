"""``kvmix compare``, the main job: memory, perplexity, token KL and time of each method."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvmix.commands.args import add_job_arguments, add_length_arguments, config_from
from kvmix.evaluation.jobs import JobConfig, finish, load_inputs, score_methods
from kvmix.evaluation.report import console
from kvmix.evaluation.scoring import Scored, check_lengths, summary
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

DEFAULT_METHODS = ("full", "kivi2", "kivi4", "kxvy:key_bits=4,value_bits=2",
                   "kxvy:key_bits=2,value_bits=4", "pnmix1")
COLUMNS = {"method": "method", "key_bits": "K bits", "value_bits": "V bits",
           "nbytes": "cache bytes", "ratio_fp16": "/16-bit", "nbytes_16bit": "bytes@16",
           "effective_bits": "eff. bits", "static": "static", "ppl": "ppl", "delta_ppl": "Δppl",
           "token_kl": "token KL", "seconds": "time s"}


@dataclass
class CompareConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    context: int = 1024
    eval_tokens: int = 256
    chunk: int = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("compare", help="memory, perplexity, token KL and time per method")
    add_job_arguments(parser, CompareConfig())
    add_length_arguments(parser, CompareConfig)
    parser.set_defaults(run=lambda args: run_compare(config_from(CompareConfig, args)))


def run_compare(config: CompareConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """Evaluate every method on the same tokens; ``full`` is always run first as the reference."""
    check_lengths(config.context, config.eval_tokens, config.chunk)
    methods = [parse_method(m) for m in config.methods]  # bad method strings fail before loading
    loaded, ids = load_inputs(config, config.context + config.eval_tokens + 1, loaded)
    scored = score_methods(loaded, ids, ["full", *config.methods], config.context, config.chunk,
                           backend=config.backend)
    rows = [_row(text, method, scored[text], scored["full"], loaded.dtype)
            for text, method in zip(config.methods, methods, strict=True)]
    for row in rows:
        if row["plan"]:
            console.print(f"{row['method']} plan: key bits {row['plan']['key_bits']}, "
                          f"value bits {row['plan']['value_bits']}")
    finish("compare", config, loaded, rows, f"{config.data} · context {config.context} + "
           f"{config.eval_tokens} tokens", COLUMNS)
    return rows


def _row(text: str, method, scored: Scored, full: Scored, dtype: torch.dtype) -> dict:
    return {"method": text, "resolved": repr(method), **summary(scored, full),
            "nbytes_theoretical": scored.theoretical_nbytes,
            "nbytes_breakdown": scored.nbytes_breakdown,
            "nbytes_dtype": scored.nbytes_fp16 * dtype.itemsize // 2,
            "ratio_dtype": scored.nbytes / (scored.nbytes_fp16 * dtype.itemsize / 2),
            "plan": scored.plan}
