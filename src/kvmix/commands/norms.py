"""``kvmix norms``: are W_K's norms larger than W_V's? (docs/guide/evaluation.md, Studies of the
papers)

Per layer (and per KV head in the JSON): spectral and Frobenius norms of the key and value
projections, their ratios, and the share of layers where the keys' norm is the larger.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmix.commands.args import add_job_arguments, config_from
from kvmix.evaluation.inputs import JobConfig
from kvmix.jobs.plots import grouped_bars
from kvmix.jobs.report import finish
from kvmix.models.loading import LoadedModel, load_model
from kvmix.models.weights import kv_weights, weight_norms

COLUMNS = {"layer": "layer", "keys_spectral": "‖W_K‖₂", "values_spectral": "‖W_V‖₂",
           "ratio_spectral": "ratio₂", "keys_frobenius": "‖W_K‖F", "values_frobenius": "‖W_V‖F",
           "ratio_frobenius": "ratioF"}


@dataclass
class NormsConfig(JobConfig):
    pass


def add_parser(commands) -> None:
    parser = commands.add_parser("norms", help="spectral/Frobenius norms of W_K vs W_V per layer")
    add_job_arguments(parser, NormsConfig(), methods=False)
    parser.set_defaults(run=lambda args: run_norms(config_from(NormsConfig, args)))


def run_norms(config: NormsConfig, loaded: LoadedModel | None = None) -> dict:
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    weights = kv_weights(loaded.model)
    norms = weight_norms(weights)
    rows = [_row(layer, norms) for layer in range(len(weights))]
    summary = {f"share_keys_larger_{kind}": sum(r[f"ratio_{kind}"] > 1 for r in rows) / len(rows)
               for kind in ("spectral", "frobenius")}
    summary["biases"] = any(w.key_bias is not None or w.value_bias is not None for w in weights)
    plots = [str(_plot(config, rows))] if config.out else []
    finish("norms", config, loaded, rows, "share of layers with ‖W_K‖ > ‖W_V‖: "
           f"spectral {summary['share_keys_larger_spectral']:.0%}, Frobenius "
           f"{summary['share_keys_larger_frobenius']:.0%}", COLUMNS, summary=summary,
           plots=plots, uses_data=False)
    return {"rows": rows, "summary": summary}


def _row(layer: int, norms: dict) -> dict:
    row = {"layer": layer}
    for kind in ("spectral", "frobenius"):
        keys, values = norms[f"keys_{kind}"][layer].item(), norms[f"values_{kind}"][layer].item()
        row |= {f"keys_{kind}": keys, f"values_{kind}": values, f"ratio_{kind}": keys / values,
                f"keys_{kind}_heads": norms[f"keys_{kind}_heads"][layer].tolist(),
                f"values_{kind}_heads": norms[f"values_{kind}_heads"][layer].tolist()}
    return row


def _plot(config: NormsConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    panels = {kind: {side: [r[f"{side}_{kind}"] for r in rows] for side in ("keys", "values")}
              for kind in ("spectral", "frobenius")}
    return grouped_bars(Path(config.out) / "norms.png", panels, "layer",
                        "‖W_K‖ vs ‖W_V‖ per layer")
