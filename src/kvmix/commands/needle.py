"""``kvmix needle``: passkey / key-value retrieval over a grid of context lengths and needle
depths, per method, with a depth × length accuracy heatmap per method."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

from rich.progress import Progress

from kvmix.commands.args import add_job_arguments, add_renamed, config_from
from kvmix.evaluation.data import load_text
from kvmix.evaluation.inputs import JobConfig, check_backend
from kvmix.evaluation.needle import ANSWER_TOKENS, KINDS, answers, build, correct, overhead
from kvmix.jobs.plots import heatmap
from kvmix.jobs.report import console, finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel, load_model, max_positions

COLUMNS = {"method": "method", "length": "length", "depth": "depth", "accuracy": "accuracy"}


@dataclass
class NeedleConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2", "pnmix1"])
    kind: str = "passkey"
    prompt_tokens: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    samples: int = 4
    seed: int = 0


def add_parser(commands) -> None:
    parser = commands.add_parser("needle", help="passkey / needle-in-a-haystack accuracy over "
                                 "context length and depth")
    add_job_arguments(parser, NeedleConfig())
    parser.add_argument("--kind", default=NeedleConfig.kind, help=" or ".join(KINDS))
    add_renamed(parser, "--prompt-tokens", "--lengths", default="1024,2048,4096",
                help="prompt lengths (filler, needle and question), e.g. 1024,2048,4096 (up to "
                     "the model's limit)")
    parser.add_argument("--depths", default="0.1,0.5,0.9",
                        help="where the needle sits in the filler, 0 (start) to 1 (end)")
    parser.add_argument("--samples", type=int, default=NeedleConfig.samples,
                        help="prompts per cell (each its own number and filler)")
    parser.add_argument("--seed", type=int, default=NeedleConfig.seed,
                        help="seed of the needles' numbers and places in the filler")
    parser.set_defaults(run=lambda args: run_needle(config_from(NeedleConfig, args)))


def run_needle(config: NeedleConfig, loaded: LoadedModel | None = None) -> list[dict]:
    _check(config)
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    _check_lengths(config, loaded)
    tokenizer = loaded.tokenizer
    filler = tokenizer(load_text(config.data), add_special_tokens=False).input_ids
    cells = _cells(config, tokenizer, filler)
    pad = tokenizer.pad_token_id or tokenizer.eos_token_id or 0
    rows = []
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task("needle", total=len(config.methods) * len(cells))
        for method in config.methods:
            for (length, depth), needles in cells.items():
                said = answers(loaded.model, tokenizer, method, needles, pad, config.backend)
                hits = [correct(a, n.answer) for a, n in zip(said, needles, strict=True)]
                rows.append({"method": method, "length": length, "depth": depth,
                             "accuracy": sum(hits) / len(hits), "answers": said,
                             "expected": [n.answer for n in needles]})
                bar.advance(task)
    plots = [str(_heatmap(config, rows, m)) for m in config.methods] if config.out else []
    finish("needle", config, loaded, rows, f"{config.kind} · {config.samples} samples per "
           f"cell · filler {config.data}", COLUMNS, plots=plots)
    return rows


def _check(config: NeedleConfig) -> None:
    if config.kind not in KINDS:
        raise ValueError(f"kind={config.kind!r} is invalid; valid: {', '.join(KINDS)}")
    if not isinstance(config.samples, int) or config.samples < 1:
        raise ValueError(f"samples={config.samples!r} is invalid; expected an integer >= 1")
    if not config.prompt_tokens or not config.depths:
        raise ValueError("prompt_tokens and depths need at least one value each")
    for depth in config.depths:
        if not 0 <= depth <= 1:
            raise ValueError(f"depths={depth} is invalid; valid: 0..1")
    check_backend(config.backend)
    for method in config.methods:
        parse_method(method)


def _check_lengths(config: NeedleConfig, loaded: LoadedModel) -> None:
    """Every length holds the instruction, needle and question, and fits the model."""
    least = overhead(loaded.tokenizer, config.kind) + 1
    limit = max_positions(loaded.model) - ANSWER_TOKENS
    for length in config.prompt_tokens:
        if not least <= length <= limit:
            raise ValueError(f"prompt_tokens={length} is invalid; valid: {least}..{limit} (the "
                             f"{config.kind} text needs {least - 1} tokens; the model's limit "
                             f"is {limit + ANSWER_TOKENS} minus {ANSWER_TOKENS} answer tokens)")


def _cells(config: NeedleConfig, tokenizer, filler: list[int]) -> dict:
    """(length, depth) -> prompts; one seeded generator, so every method reads the same ones."""
    rng = random.Random(config.seed)
    return {(length, depth): [build(tokenizer, filler, length, depth, config.kind, rng)
                              for _ in range(config.samples)]
            for length in config.prompt_tokens for depth in config.depths}


def _heatmap(config: NeedleConfig, rows: list[dict], method: str) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    grid = {(r["length"], r["depth"]): r["accuracy"] for r in rows if r["method"] == method}
    values = [[grid[length, depth] for length in config.prompt_tokens]
              for depth in config.depths]
    return heatmap(Path(config.out) / f"needle_{_filename(method)}.png", values,
                   [str(n) for n in config.prompt_tokens], [f"{d:g}" for d in config.depths],
                   "context length (tokens)", "needle depth",
                   f"{config.kind} accuracy · {method}")


def _filename(method: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in method)
