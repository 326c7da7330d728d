"""``kvmix transforms`` and ``kvmix export``: WUSH-KV's comparisons and its serving artifacts.

``transforms``: at equal bits, every transform (identity, Hadamard, WUS, WUSH) × quantizer (QuEST,
percentile): the layer-wise error of attention scores when keys are quantized, of attention
outputs after W_O when values are quantized, and token KL and perplexity through the cache.
Calibration runs on ``calib_data`` (code by default) so calibration and evaluation differ.

``export``: the model with values folded (``save_pretrained``) and one safetensors file of the
right-multipliers per (layer, KV head, block), float64, each [L, H, D/block, block, block]:
``k_right = T_kᵀ`` (k' = k·k_right), ``q_right = T_k⁻¹`` (q' = q·q_right), ``v_right = T_vᵀ``
(v' = v·v_right, what the folded W_V produces) and ``o_right = T_v⁻ᵀ`` (o = o'·o_right, what the
folded W_O undoes), so ``q_right·k_rightᵀ = I`` and ``v_right·o_right = I``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvmix.evaluation.analysis import Captured, capture
from kvmix.evaluation.calibration import CalibrateConfig, run_calibrate
from kvmix.evaluation.scoring import check_lengths, summary
from kvmix.runtime.folding import prepare_model
from kvmix.evaluation.jobs import JobConfig, finish, load_inputs, score_methods
from kvmix.methods import parse_method
from kvmix.methods.wush import QUANTIZERS
from kvmix.models.loading import LoadedModel
from kvmix.evaluation.plots import line_plot
from kvmix.evaluation.report import console
from kvmix.core.transforms import KINDS, TransformSet
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
                           ["full", *methods.values()], config.context, config.chunk)
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


def layer_errors(captured: Captured, method, outputs: list[torch.Tensor],
                 bits: int) -> dict[str, list[float]]:
    """Relative error per layer of scores (keys quantized) and of W_O outputs (values)."""
    keys_t = method.loaded.keys[method.transform].float()  # [L, H, D, D]
    values_t = method.loaded.values[method.transform].float()
    result = {"keys": [], "values": []}
    for layer in sorted(captured.keys):
        query, scale = captured.decode_queries[layer].float(), captured.scaling[layer]
        keys, values = captured.keys[layer].float(), captured.values[layer].float()
        group = query.shape[1] // keys.shape[1]
        k_hat = _round_trip(method, keys, keys_t[layer], bits)
        v_hat = _round_trip(method, values, values_t[layer], bits)
        exact = query @ keys.repeat_interleave(group, 1).transpose(-1, -2) * scale  # [B,Hq,N,C]
        approx = query @ k_hat.repeat_interleave(group, 1).transpose(-1, -2) * scale
        result["keys"].append(_relative(approx, exact))
        weights = exact.softmax(-1)
        w_o = outputs[layer].float().unflatten(1, (group, -1))  # [H, g, hidden, D]
        out = _project(weights @ values.repeat_interleave(group, 1), w_o)
        out_hat = _project(weights @ v_hat.repeat_interleave(group, 1), w_o)
        result["values"].append(_relative(out_hat, out))
    return result


def run_export(transforms: str, transform: str, model_out: str,
               loaded: LoadedModel) -> dict[str, Path]:
    """Save the folded model and the right-multipliers (see the module docstring)."""
    method = parse_method(f"wush:transforms={transforms},transform={transform}")
    folded = prepare_model(loaded.model, method)
    out = Path(model_out)
    out.mkdir(parents=True, exist_ok=True)
    _drop_gguf_marker(folded)
    folded.save_pretrained(out / "model")
    loaded.tokenizer.save_pretrained(out / "model")
    path = save_multipliers(out / "right_multipliers.safetensors", method.loaded, transform)
    console.print(f"wrote {out / 'model'} and {path}")
    return {"model": out / "model", "multipliers": path}


def _drop_gguf_marker(model) -> None:
    """GGUF loading dequantizes every tensor; only its marker, which blocks save_pretrained, is
    left. kvmix's folded copy drops it (the user's model keeps it)."""
    config = getattr(model.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(
        config, "quant_method", None)
    if getattr(method, "value", method) == "gguf":
        model.hf_quantizer = None
        model.is_quantized = False
        del model.config.quantization_config


def right_multipliers(transforms: TransformSet, transform: str) -> dict[str, torch.Tensor]:
    """Per (layer, KV head, block): [L, H, D/block, block, block] float64."""
    block = int(transforms.meta["block"])
    t_k, t_v = transforms.keys[transform].double(), transforms.values[transform].double()
    full = {"k_right": t_k.transpose(-1, -2), "q_right": torch.linalg.inv(t_k),
            "v_right": t_v.transpose(-1, -2), "o_right": torch.linalg.inv(t_v).transpose(-1, -2)}
    return {name: _blocks(matrix, block) for name, matrix in full.items()}


def save_multipliers(path: Path, transforms: TransformSet, transform: str) -> Path:
    meta = {**transforms.meta, "transform": transform,
            "layout": "[layer, kv_head, block_index, block, block]; x' = x @ right per block"}
    save_file({k: v.contiguous() for k, v in right_multipliers(transforms, transform).items()},
              str(path), metadata=meta)
    return path


def _blocks(matrix: torch.Tensor, block: int) -> torch.Tensor:
    count = matrix.shape[-1] // block
    return torch.stack([matrix[..., i * block:(i + 1) * block, i * block:(i + 1) * block]
                        for i in range(count)], dim=2)


def _round_trip(method, x: torch.Tensor, transform: torch.Tensor, bits: int) -> torch.Tensor:
    # x: [B, H, C, D]; transform: [H, D, D] -> x̂ = Q(x Tᵀ) T^{-ᵀ}
    moved = torch.einsum("bhtd,hed->bhte", x, transform)
    restored = method.dequantize_tokens(method.quantize_tokens(moved, bits), torch.float32)
    return torch.einsum("bhte,hed->bhtd", restored, torch.linalg.inv(transform).transpose(-1, -2))


def _project(heads_out: torch.Tensor, w_o: torch.Tensor) -> torch.Tensor:
    # heads_out: [B, Hq, N, D]; w_o: [H, g, hidden, D] -> [B, N, hidden]
    return torch.einsum("bhnd,hod->bno", heads_out, w_o.flatten(0, 1))


def _relative(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return ((approx - exact).norm() / exact.norm()).item()


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
