"""``kvmix criteria``: PN-Mix's four selection criteria at the same bit budget
(docs/guide/evaluation.md, Studies of the papers).

For each criterion: attention KL of decode queries over the quantized context, per layer and
averaged, plus token KL and perplexity through the cache; a PNG of attention KL per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmix.commands.args import add_job_arguments, add_length_arguments, config_from
from kvmix.core.importance import CRITERIA
from kvmix.evaluation.analysis import attention_kl, capture
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.evaluation.scoring import check_lengths, score_methods, summary
from kvmix.jobs.plots import line_plot
from kvmix.jobs.report import finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

COLUMNS = {"criterion": "criterion", "key_bits": "K bits", "attention_kl": "attention KL",
           "token_kl": "token KL", "ppl": "ppl"}


@dataclass
class CriteriaConfig(JobConfig):
    base: str = "pnmix1"
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA))
    context: int = 2048
    eval_tokens: int = 256
    queries: int = 64
    chunk: int = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("criteria", help="PN-Mix selection criteria at one bit budget")
    add_job_arguments(parser, CriteriaConfig(), methods=False)
    parser.add_argument("--base", default=CriteriaConfig.base,
                        help="PN-Mix method whose criterion is varied (e.g. pnmix1)")
    parser.add_argument("--criteria", default=",".join(CriteriaConfig().criteria),
                        help="comma-separated criteria")
    add_length_arguments(parser, CriteriaConfig)
    parser.add_argument("--queries", type=int, default=CriteriaConfig.queries,
                        help="decode queries for attention KL")
    parser.set_defaults(run=lambda args: run_criteria(config_from(CriteriaConfig, args)))


def run_criteria(config: CriteriaConfig, loaded: LoadedModel | None = None) -> list[dict]:
    check_lengths(config.context, config.eval_tokens, config.chunk)
    check_lengths(config.context, config.queries, 1)
    methods = [f"{config.base},criterion={c}" if ":" in config.base
               else f"{config.base}:criterion={c}" for c in config.criteria]
    for method in methods:
        parse_method(method)
    loaded, ids = load_inputs(config, config.context + max(config.eval_tokens, config.queries) + 1,
                              loaded)
    captured = capture(loaded.model, ids[:, : config.context + config.queries], config.context)
    scored = score_methods(loaded, ids[:, : config.context + config.eval_tokens + 1],
                           ["full", *methods], config.context, config.chunk, backend=config.backend)
    rows = []
    for criterion, method in zip(config.criteria, methods, strict=True):
        per_layer = attention_kl(loaded.model, captured, method).mean(-1)  # [L]
        rows.append({"criterion": criterion, "method": method,
                     **summary(scored[method], scored["full"]),
                     "attention_kl": per_layer.mean().item(),
                     "attention_kl_per_layer": per_layer.tolist()})
    plot = _plot(config, rows)
    finish("criteria", config, loaded, rows, f"{config.data} · context {config.context} · "
           f"{config.base}", COLUMNS, plots=[str(plot)] if plot else [])
    return rows


def _plot(config: CriteriaConfig, rows: list[dict]) -> Path | None:
    if not config.out:
        return None
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series = {r["criterion"]: r["attention_kl_per_layer"] for r in rows}
    return line_plot(Path(config.out) / "attention_kl.png", series, "layer", "attention KL",
                     f"{config.base}: attention KL per layer by criterion", log=True)
