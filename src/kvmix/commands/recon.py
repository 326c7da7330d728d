"""``kvmix recon``: at equal bits, how much worse are quantized keys than quantized values?
(docs/guide/evaluation.md, Studies of the papers)

On real activations (a full-precision prefill of ``context`` tokens, then ``queries`` decode
queries), per layer and for 1, 2, 3 and 4 bits: the relative (and RMS) reconstruction error of
the key cache (per channel, groups of ``group`` tokens) and of the value cache (per token, groups
of ``value_group`` channels), and what each does downstream: the relative error of the attention
scores ``q·kᵀ`` (keys quantized) and of the attention outputs (keys only, or values only,
quantized).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmix.commands.args import add_job_arguments, config_from
from kvmix.core.quantizers import dequantize, dequantize_per_token, quantize, quantize_per_token
from kvmix.evaluation.analysis import Captured, capture
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.jobs.plots import line_plot
from kvmix.jobs.report import finish
from kvmix.models.loading import LoadedModel

COLUMNS = {"bits": "bits", "key_error": "key rel. err", "value_error": "value rel. err",
           "key_rms_error": "key RMS err", "value_rms_error": "value RMS err",
           "score_error": "score rel. err", "output_error_keys": "output err (K quant)",
           "output_error_values": "output err (V quant)", "keys_worse": "layers K worse"}


@dataclass
class ReconConfig(JobConfig):
    bits: list[int] = field(default_factory=lambda: [1, 2, 3, 4])
    context: int = 1024
    queries: int = 64
    group: int = 32
    value_group: int = 32


def add_parser(commands) -> None:
    parser = commands.add_parser("recon", help="key vs value reconstruction error at equal bits")
    add_job_arguments(parser, ReconConfig(), methods=False)
    parser.add_argument("--bits", default="1,2,3,4", help="comma-separated widths")
    parser.add_argument("--context", type=int, default=ReconConfig.context,
                        help="tokens of text prefilled in full precision, then quantized (a "
                             "multiple of --group)")
    parser.add_argument("--queries", type=int, default=ReconConfig.queries,
                        help="decode queries for the score and output errors")
    parser.add_argument("--group", type=int, default=ReconConfig.group,
                        help="tokens per key group (keys are quantized per channel)")
    parser.add_argument("--value-group", type=int, default=ReconConfig.value_group,
                        help="channels per value group (values are quantized per token)")
    parser.set_defaults(run=lambda args: run_recon(config_from(ReconConfig, args)))


def run_recon(config: ReconConfig, loaded: LoadedModel | None = None) -> list[dict]:
    if config.context % config.group:
        raise ValueError(f"context={config.context} must be a multiple of group={config.group}")
    loaded, ids = load_inputs(config, config.context + config.queries, loaded)
    captured = capture(loaded.model, ids, config.context)
    rows = []
    for bits in config.bits:
        per_layer = [layer_errors(captured, layer, bits, config) for layer in sorted(captured.keys)]
        row = {key: sum(e[key] for e in per_layer) / len(per_layer) for key in per_layer[0]}
        row |= {"bits": bits, "keys_worse": sum(e["key_error"] > e["value_error"]
                                               for e in per_layer) / len(per_layer),
                "per_layer": per_layer}
        rows.append(row)
    plots = [str(_plot(config, rows))] if config.out else []
    finish("recon", config, loaded, rows, f"{config.data} · context {config.context} · mean "
           "over layers", COLUMNS, plots=plots)
    return rows


def layer_errors(captured: Captured, layer: int, bits: int, config: ReconConfig) -> dict:
    keys, values = captured.keys[layer].float(), captured.values[layer].float()  # [B, H, C, D]
    query, scale = captured.decode_queries[layer].float(), captured.scaling[layer]
    blocks = keys.unflatten(2, (-1, config.group))  # [B, H, C/G, G, D]
    keys_hat = dequantize(quantize(blocks, bits, dim=-2)).flatten(2, 3)
    values_hat = dequantize_per_token(quantize_per_token(values, bits, config.value_group),
                                      torch.float32)
    repeat = query.shape[1] // keys.shape[1]
    k, k_hat, v, v_hat = (x.repeat_interleave(repeat, 1) for x in (keys, keys_hat, values,
                                                                      values_hat))
    scores = query @ k.transpose(-1, -2) * scale  # [B, Hq, N, C]
    scores_hat = query @ k_hat.transpose(-1, -2) * scale
    out = scores.softmax(-1) @ v
    return {"key_error": _relative(keys_hat, keys), "value_error": _relative(values_hat, values),
            "key_rms_error": _rms(keys_hat - keys), "value_rms_error": _rms(values_hat - values),
            "score_error": _relative(scores_hat, scores),
            "output_error_keys": _relative(scores_hat.softmax(-1) @ v, out),
            "output_error_values": _relative(scores.softmax(-1) @ v_hat, out)}


def _rms(error: torch.Tensor) -> float:
    return error.pow(2).mean().sqrt().item()


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


def _plot(config: ReconConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series = {}
    for row in rows:
        series[f"keys {row['bits']}-bit"] = [e["key_error"] for e in row["per_layer"]]
        series[f"values {row['bits']}-bit"] = [e["value_error"] for e in row["per_layer"]]
    return line_plot(Path(config.out) / "recon.png", series, "layer", "relative error",
                     "key vs value cache reconstruction error", log=True)
