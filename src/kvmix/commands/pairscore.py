"""``kvmix pairscore``: does PN-Mix's separable score ``E‖q_p‖·E‖k_p‖`` rank RoPE pairs like the
causal score ``mean_{i≥j} ‖q_{i,p}‖‖k_{j,p}‖``? Spearman correlation and top-``ratio`` overlap
per layer and KV head, over a prefilled context (the PN-Mix paper's validation;
docs/guide/evaluation.md)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmix.commands.args import add_job_arguments, config_from
from kvmix.evaluation.analysis import capture, pair_score_agreement
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.jobs.plots import line_plot
from kvmix.jobs.report import finish
from kvmix.models.loading import LoadedModel

COLUMNS = {"layer": "layer", "spearman_mean": "Spearman mean", "spearman_min": "Spearman min",
           "overlap_mean": "top overlap"}


@dataclass
class PairscoreConfig(JobConfig):
    context: int = 2048
    ratio: float = 0.5


def add_parser(commands) -> None:
    parser = commands.add_parser("pairscore", help="separable vs causal PN-Mix pair score")
    add_job_arguments(parser, PairscoreConfig(), methods=False)
    parser.add_argument("--context", type=int, default=PairscoreConfig.context,
                        help="tokens of text prefilled, whose queries and keys are scored")
    parser.add_argument("--ratio", type=float, default=PairscoreConfig.ratio,
                        help="share of pairs for the top-k overlap")
    parser.set_defaults(run=lambda args: run_pairscore(config_from(PairscoreConfig, args)))


def run_pairscore(config: PairscoreConfig, loaded: LoadedModel | None = None) -> dict:
    if not isinstance(config.context, int) or config.context < 2:
        raise ValueError(f"context={config.context!r} is invalid; expected an integer >= 2")
    if not 0 < config.ratio <= 1:
        raise ValueError(f"ratio={config.ratio!r} is invalid; expected a number in (0, 1]")
    loaded, ids = load_inputs(config, config.context, loaded)
    agreement = pair_score_agreement(loaded.model, capture(loaded.model, ids, config.context),
                                     config.ratio)
    rho, overlap = agreement["spearman"], agreement["overlap"]  # [L, H]
    rows = [{"layer": layer, "spearman_mean": rho[layer].mean().item(),
             "spearman_min": rho[layer].min().item(), "overlap_mean": overlap[layer].mean().item(),
             "spearman_heads": rho[layer].tolist(), "overlap_heads": overlap[layer].tolist()}
            for layer in range(rho.shape[0])]
    summary = {"spearman_median": rho.median().item(), "spearman_min": rho.min().item(),
               "overlap_mean": overlap.mean().item(), "ratio": config.ratio}
    rows.append({"layer": "all", "spearman_mean": rho.mean().item(),
                 "spearman_min": summary["spearman_min"], "overlap_mean": summary["overlap_mean"]})
    plots = []
    if config.out:
        Path(config.out).mkdir(parents=True, exist_ok=True)
        plots.append(str(line_plot(Path(config.out) / "pairscore.png",
                                   {"Spearman (mean over heads)": rho.mean(-1).tolist(),
                                    f"top-{config.ratio:.0%} overlap": overlap.mean(-1).tolist()},
                                   "layer", "agreement", "separable vs causal pair score")))
    finish("pairscore", config, loaded, rows, f"{config.data} · context {config.context} · "
           f"median Spearman {summary['spearman_median']:.3f}", COLUMNS, summary=summary,
           plots=plots)
    return {"rows": rows, "summary": summary}
