"""``kvmix transforms``: WUSH-KV's comparisons of transforms and quantizers at equal bits.

``transforms``: at equal bits, every transform (identity, Hadamard, WUS, WUSH) × quantizer (QuEST,
percentile): the layer-wise error of attention scores when keys are quantized, of attention
outputs after W_O when values are quantized, and token KL and perplexity through the cache.
Calibration runs on ``calib_data`` (code by default) so calibration and evaluation differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmix.commands.args import add_job_arguments, add_length_arguments, config_from
from kvmix.commands.calibrate import CalibrateConfig, run_calibrate
from kvmix.core.transforms import KINDS
from kvmix.evaluation.analysis import capture, layer_errors
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.evaluation.scoring import check_lengths, score_methods, summary
from kvmix.jobs.plots import line_plot
from kvmix.jobs.report import finish
from kvmix.methods import parse_method
from kvmix.methods.wush import QUANTIZERS
from kvmix.models.loading import LoadedModel
from kvmix.models.weights import output_weights

COLUMNS = {"transform": "transform", "quantizer": "quantizer", "key_bits": "K bits",
           "key_score_error": "score err (K)", "value_output_error": "output err (V)",
           "token_kl": "token KL", "ppl": "ppl"}


@dataclass
class TransformsConfig(JobConfig):
    transforms: str = ""  # a file from kvmix calibrate; empty: calibrate first
    calib_data: str = "code"
    calib_tokens: int = 4096
    bits: int = 2
    kinds: list[str] = field(default_factory=lambda: list(KINDS))
    quantizers: list[str] = field(default_factory=lambda: list(QUANTIZERS))
    context: int = 2048
    eval_tokens: int = 256
    queries: int = 64
    chunk: int = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("transforms",
                                 help="WUSH-KV transforms × quantizers at equal bits")
    add_job_arguments(parser, TransformsConfig(), methods=False)
    parser.add_argument("--transforms", default="", help="file from kvmix calibrate "
                        "(default: calibrate on --calib-data first)")
    parser.add_argument("--calib-data", default=TransformsConfig.calib_data,
                        help="calibration text when no --transforms file is given: 'prose', "
                             "'code' or a text file")
    parser.add_argument("--calib-tokens", type=int, default=TransformsConfig.calib_tokens,
                        help="calibration tokens when no --transforms file is given")
    parser.add_argument("--bits", type=int, default=TransformsConfig.bits,
                        help="key and value bits of every transform × quantizer")
    parser.add_argument("--queries", type=int, default=TransformsConfig.queries,
                        help="decode queries for the layer-wise score and output errors")
    add_length_arguments(parser, TransformsConfig)
    parser.set_defaults(run=lambda args: run_transforms(config_from(TransformsConfig, args)))


def run_transforms(config: TransformsConfig, loaded: LoadedModel | None = None) -> list[dict]:
    check_lengths(config.context, config.eval_tokens, config.chunk)
    loaded, ids = load_inputs(config, config.context + max(config.eval_tokens, config.queries) + 1,
                              loaded)
    path = config.transforms or _calibrate(config, loaded)
    methods = {(kind, q): f"wush:transforms={path},transform={kind},quantizer={q},"
                          f"key_bits={config.bits},value_bits={config.bits}"
               for kind in config.kinds for q in config.quantizers}
    captured = capture(loaded.model, ids[:, : config.context + config.queries], config.context)
    scored = score_methods(loaded, ids[:, : config.context + config.eval_tokens + 1],
                           ["full", *methods.values()], config.context, config.chunk,
                           backend=config.backend)
    outputs = output_weights(loaded.model)
    rows = []
    for (kind, quantizer), method in methods.items():
        errors = layer_errors(captured, parse_method(method), outputs, config.bits)
        rows.append({"transform": kind, "quantizer": quantizer, "method": method,
                     **summary(scored[method], scored["full"]),
                     "key_score_error": sum(errors["keys"]) / len(errors["keys"]),
                     "value_output_error": sum(errors["values"]) / len(errors["values"]),
                     "per_layer": errors})
    plots = _plot(config, rows) if config.out else []
    finish("transforms", config, loaded, rows, f"{config.data} · {config.bits}-bit · context "
           f"{config.context} · calibrated on {config.calib_data}", COLUMNS,
           transforms_file=str(path), plots=plots)
    return rows


def _calibrate(config: TransformsConfig, loaded: LoadedModel) -> Path:
    out = Path(config.out or ".kvmix") / "calibration"
    calibrate = CalibrateConfig(model=config.model, data=config.calib_data,
                                tokens=config.calib_tokens, dtype=config.dtype,
                                device=config.device, out=str(out))
    run_calibrate(calibrate, loaded)
    return out / "transforms.safetensors"


def _plot(config: TransformsConfig, rows: list[dict]) -> list[str]:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    paths = []
    for side, label in (("keys", "attention score error"), ("values", "output error after W_O")):
        series = {f"{r['transform']}+{r['quantizer']}": r["per_layer"][side] for r in rows}
        paths.append(str(line_plot(Path(config.out) / f"{side}_error.png", series, "layer",
                                   f"relative {label}", f"{config.bits}-bit {side}", log=True)))
    return paths
