"""``kvmix longgen``: long greedy generation against the ``full`` cache (docs/guide/evaluation.md) —
where each method's output first leaves ``full``'s (a survival curve), exact match and chrF of the
texts, and the KL of its next-token distributions along ``full``'s trajectory (teacher-forced) and
along its own (free-running); the gap between the two is error compounding.

Samples are appended to ``samples.jsonl`` as they finish; a rerun with the same settings and
``--out`` skips the ones already there (a killed run resumes where it stopped).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

from kvmix.commands.args import add_grid_arguments, add_job_arguments, config_from
from kvmix.evaluation.data import prompt_set
from kvmix.evaluation.generation import first_divergence, paired_decode, survival
from kvmix.evaluation.inputs import JobConfig, check_backend
from kvmix.jobs.grid import Grid, GridConfig, Worker, check_grid, merged
from kvmix.jobs.plots import line_plot, scatter_lines
from kvmix.jobs.report import console, finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel, load_config, load_tokenizer, max_positions

COLUMNS = {"method": "method", "first_divergence_median": "1st divergence (median)",
           "survival_quarter": "identical @n/4", "survival_end": "identical @n",
           "exact_match": "exact match", "chrf": "chrF", "kl_teacher_forced": "KL teacher-forced",
           "kl_free_running": "KL free-running", "kl_gap": "free/teacher"}
BINS = 16
MAX_NEW_TOKENS = 4096


@dataclass
class LonggenConfig(GridConfig, JobConfig):
    methods: list[str] = field(default_factory=lambda: ["kivi2", "pnmix1"])
    new_tokens: int = 1024
    prompts: int = 8
    prompt_tokens: int = 256  # window length for prose, code and text files
    batch: int = 4


def add_parser(commands) -> None:
    parser = commands.add_parser("longgen", help="long greedy generation vs full: divergence, "
                                 "chrF, teacher-forced and free-running KL")
    add_job_arguments(parser, LonggenConfig())
    parser.add_argument("--new-tokens", type=int, default=LonggenConfig.new_tokens,
                        help=f"greedy tokens generated per prompt (at most {MAX_NEW_TOKENS})")
    parser.add_argument("--prompts", type=int, default=LonggenConfig.prompts,
                        help="how many prompts (--data humaneval: its problems, in order)")
    parser.add_argument("--prompt-tokens", type=int, default=LonggenConfig.prompt_tokens,
                        help="prompt length for prose, code and text files")
    parser.add_argument("--batch", type=int, default=LonggenConfig.batch,
                        help="prompts generated together (left-padded)")
    add_grid_arguments(parser)
    parser.set_defaults(run=lambda args: run_longgen(config_from(LonggenConfig, args)))


def run_longgen(config: LonggenConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """One cell per method and batch of prompts not in ``samples.jsonl`` yet
    (``jobs.grid``: here or on Ray)."""
    _check(config)
    _chrf()
    check_grid(config)
    _prompts(config, loaded)  # lengths beyond the model's positions fail before any work
    samples = _Samples(config)
    cells = [(method, tuple(todo[start : start + config.batch]))
             for method in config.methods
             for todo in [[i for i in range(config.prompts) if (method, i) not in samples.done]]
             for start in range(0, len(todo), config.batch)]
    outcomes, model = Grid("longgen", config, longgen_cell, shared=config).run(
        cells, Worker.holding(loaded, config))
    for record in merged(outcomes):
        samples.add(record)
    rows = [_row(method, samples.of(method), config.new_tokens) for method in config.methods
            if samples.of(method)]
    plots = _plots(config, samples) if config.out else []
    finish("longgen", config, model, rows, f"{config.data} · {config.prompts} prompts · "
           f"{config.new_tokens} greedy tokens vs full", COLUMNS, plots=plots)
    return rows


def longgen_cell(worker: Worker, config: LonggenConfig, cell: tuple) -> list[dict]:
    """One method on a batch of prompts: a record per prompt."""
    method, chosen = cell
    loaded = worker.loaded
    prompts = worker.memo("prompts", lambda: _prompts(config, loaded))
    return _run(loaded, method, [prompts[i] for i in chosen], list(chosen), config,
                worker.memo("chrf", _chrf), None)


def _prompts(config: LonggenConfig, loaded: LoadedModel | None) -> list[list[int]]:
    """The prompts' tokens, refused when the longest run exceeds the model's positions
    (without ``loaded``: its tokenizer and configuration alone)."""
    tokenizer = loaded.tokenizer if loaded else load_tokenizer(config.model)
    positions = max_positions(loaded.model if loaded else load_config(config.model)[0])
    prompts = prompt_set(config.data, tokenizer, config.prompts, config.prompt_tokens)
    longest = max(map(len, prompts)) + config.new_tokens
    if longest > positions:
        raise ValueError(f"new_tokens={config.new_tokens} after a {longest - config.new_tokens}"
                         f"-token prompt exceeds the model's {positions} positions")
    return prompts


def _check(config: LonggenConfig) -> None:
    for name in ("new_tokens", "prompts", "prompt_tokens", "batch"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; expected an integer >= 1")
    if config.new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"new_tokens={config.new_tokens} is invalid; valid: 1..{MAX_NEW_TOKENS}")
    check_backend(config.backend)
    for method in config.methods:
        parse_method(method)


def _chrf():
    try:
        from sacrebleu.metrics import CHRF
    except ImportError:
        raise ValueError("longgen scores chrF with sacrebleu: pip install 'kvmix[eval]'") from None
    metric = CHRF()
    return lambda text, reference: metric.sentence_score(text, [reference]).score


def _run(loaded, method, prompts, indices, config, chrf, progress) -> list[dict]:
    """One batch: the teacher-forced and the free-running pass, one record per prompt."""
    pad = loaded.tokenizer.pad_token_id or loaded.tokenizer.eos_token_id or 0
    args = (loaded.model, "full", method, prompts, config.new_tokens, pad)
    forced = paired_decode(*args, follow="reference", backend=config.backend,
                           progress=progress)
    free = paired_decode(*args, follow="method", backend=config.backend, progress=progress)
    divergence = first_divergence(free.tokens, forced.tokens)
    records = []
    for b, index in enumerate(indices):
        text, reference = (loaded.tokenizer.decode(t[b]) for t in (free.tokens, forced.tokens))
        records.append({
            "method": method, "prompt": index, **_key(config),
            "first_divergence": int(divergence[b]), "exact": text == reference,
            "chrf": chrf(text, reference),
            "kl_teacher_forced": [round(x, 7) for x in forced.kl[b].tolist()],
            "kl_free_running": [round(x, 7) for x in free.kl[b].tolist()],
            "tokens": free.tokens[b].tolist(), "reference": forced.tokens[b].tolist()})
    return records


def _key(config: LonggenConfig) -> dict:
    """What a stored sample must share with this run to be reused."""
    return {"model": config.model, "data": config.data, "new_tokens": config.new_tokens,
            "prompts": config.prompts, "prompt_tokens": config.prompt_tokens,
            "backend": config.backend, "dtype": config.dtype}


class _Samples:
    """Records by (method, prompt), appended to ``out/samples.jsonl`` as they arrive."""

    def __init__(self, config: LonggenConfig):
        self.key = _key(config)
        self.path = Path(config.out) / "samples.jsonl" if config.out else None
        self.done: dict[tuple[str, int], dict] = {}
        if self.path and self.path.exists():
            for line in self.path.read_text().splitlines():
                record = json.loads(line)
                if all(record.get(k) == v for k, v in self.key.items()):
                    self.done[record["method"], record["prompt"]] = record
            if self.done:
                console.print(f"resuming: {len(self.done)} samples already in {self.path}")

    def add(self, record: dict) -> None:
        self.done[record["method"], record["prompt"]] = record
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as file:
                file.write(json.dumps(record) + "\n")

    def of(self, method: str) -> list[dict]:
        return [r for (m, _), r in sorted(self.done.items()) if m == method]


def _row(method: str, records: list[dict], new_tokens: int) -> dict:
    divergence = [r["first_divergence"] for r in records]
    curve = survival(divergence, new_tokens)
    forced = statistics.fmean(x for r in records for x in r["kl_teacher_forced"])
    free = statistics.fmean(x for r in records for x in r["kl_free_running"])
    return {"method": method, "prompts": len(records),
            "first_divergence_median": statistics.median(divergence),
            "first_divergence": divergence, "survival_quarter": curve[new_tokens // 4],
            "survival_end": curve[new_tokens - 1],
            "exact_match": statistics.fmean(r["exact"] for r in records),
            "chrf": statistics.fmean(r["chrf"] for r in records),
            "kl_teacher_forced": forced, "kl_free_running": free,
            "kl_gap": free / forced if forced > 0 else None,
            "kl_teacher_forced_binned": _binned(records, "kl_teacher_forced"),
            "kl_free_running_binned": _binned(records, "kl_free_running")}


def _binned(records: list[dict], key: str) -> list[float]:
    """Mean KL over prompts in BINS equal position bins."""
    length = len(records[0][key])
    edges = [round(length * i / BINS) for i in range(BINS + 1)]
    return [statistics.fmean(x for r in records for x in r[key][lo:hi])
            for lo, hi in pairwise(edges) if hi > lo]


def _plots(config: LonggenConfig, samples: _Samples) -> list[str]:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    curves = {m: survival([r["first_divergence"] for r in samples.of(m)], config.new_tokens)
              for m in config.methods}
    first = line_plot(out / "survival.png", curves, "tokens generated",
                      "share of prompts identical to full", f"greedy agreement with full "
                      f"({config.data})")
    width = config.new_tokens / BINS
    series = {}
    for method in config.methods:
        for key, label in (("kl_teacher_forced", "teacher-forced"),
                           ("kl_free_running", "free-running")):
            values = _binned(samples.of(method), key)
            series[f"{method} {label}"] = [((i + 0.5) * width, v) for i, v in enumerate(values)]
    second = scatter_lines(out / "kl.png", series, "position", "KL(full ‖ method), bin mean",
                           "teacher-forced vs free-running KL", log=True)
    return [str(first), str(second)]
