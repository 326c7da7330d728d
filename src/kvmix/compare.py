"""``kvmix compare``, the main job: memory, perplexity, token KL and time of each method."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from rich.progress import Progress

from kvmix.data import load_text, token_ids
from kvmix.evaluate import Scored, check_lengths, score, token_kl
from kvmix.methods import parse_method
from kvmix.models import DEFAULT_MODEL, LoadedModel, load_model, model_info
from kvmix.report import console, print_table, write_results

DEFAULT_METHODS = ("full", "kivi2", "kivi4", "kxvy:key_bits=4,value_bits=2",
                   "kxvy:key_bits=2,value_bits=4")
COLUMNS = {"method": "method", "key_bits": "K bits", "value_bits": "V bits",
           "nbytes": "cache bytes", "ratio_fp16": "/16-bit", "ppl": "ppl",
           "delta_ppl": "Δppl", "token_kl": "token KL", "seconds": "time s"}


@dataclass
class CompareConfig:
    model: str = DEFAULT_MODEL
    data: str = "prose"
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    context: int = 1024
    eval_tokens: int = 256
    chunk: int = 1
    dtype: str = "auto"
    device: str = "cpu"
    out: str | None = None


def run_compare(config: CompareConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """Evaluate every method on the same tokens; ``full`` is always run first as the reference."""
    check_lengths(config.context, config.eval_tokens, config.chunk)
    methods = [parse_method(m) for m in config.methods]  # bad method strings fail before loading
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    ids = token_ids(loaded.tokenizer, load_text(config.data),
                    config.context + config.eval_tokens + 1, f"data={config.data!r}")
    scored = _score_all(loaded, ids, ["full", *config.methods], config)
    rows = [_row(text, method, scored[text], scored["full"], loaded.dtype)
            for text, method in zip(config.methods, methods, strict=True)]
    print_table(f"kvmix compare · {loaded.name} · {config.data} · context {config.context} "
                f"+ {config.eval_tokens} tokens", rows, COLUMNS)
    if config.out:
        path = write_results(config.out, "compare", config, rows, model=model_info(loaded),
                             data={"name": config.data, "tokens": ids.shape[1]})
        console.print(f"wrote {path}")
    return rows


def _score_all(loaded: LoadedModel, ids: torch.Tensor, methods: list[str],
               config: CompareConfig) -> dict[str, Scored]:
    """Score each distinct method string once, in order."""
    results: dict[str, Scored] = {}
    with Progress(console=console, transient=True) as bar:
        for method in dict.fromkeys(methods):
            task = bar.add_task(method, total=config.eval_tokens)
            results[method] = score(loaded.model, ids, method, config.context, config.chunk,
                                    progress=lambda n, t=task: bar.advance(t, n))
    return results


def _row(text: str, method, scored: Scored, full: Scored, dtype: torch.dtype) -> dict:
    key_bits, value_bits = scored.bits
    return {
        "method": text,
        "resolved": repr(method),
        "key_bits": key_bits,
        "value_bits": value_bits,
        "nbytes": scored.nbytes,
        "nbytes_theoretical": scored.theoretical_nbytes,
        "nbytes_breakdown": scored.nbytes_breakdown,
        "nbytes_fp16": scored.nbytes_fp16,
        "nbytes_dtype": scored.nbytes_fp16 * dtype.itemsize // 2,
        "ratio_fp16": scored.nbytes / scored.nbytes_fp16,
        "ratio_dtype": scored.nbytes / (scored.nbytes_fp16 * dtype.itemsize / 2),
        "ppl": scored.ppl,
        "delta_ppl": scored.ppl - full.ppl,
        "token_kl": token_kl(full.logprobs, scored.logprobs),
        "seconds": scored.seconds,
    }
