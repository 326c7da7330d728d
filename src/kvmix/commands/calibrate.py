"""``kvmix calibrate``: WUSH-KV transforms from calibration text, saved with the model name,
shapes, damping, data and a checksum (the moments and closed form: kvmix.evaluation.calibration)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvmix.commands.args import add_job_arguments, add_renamed, config_from
from kvmix.core.transforms import TransformSet, save_transforms
from kvmix.evaluation.calibration import collect_moments, compute_transforms
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.jobs.report import console, finish
from kvmix.models.loading import LoadedModel
from kvmix.runtime.attention import make_cache


@dataclass
class CalibrateConfig(JobConfig):
    data: str = "code"
    tokens: int = 4096
    chunk: int = 1024
    block: int | None = None  # channels per transform block; default the head dim
    damping: float = 0.01


def add_parser(commands) -> None:
    parser = commands.add_parser("calibrate", help="WUSH-KV transforms from calibration text")
    add_job_arguments(parser, CalibrateConfig(), methods=False, data=False)
    add_renamed(parser, "--calib-data", "--data", dest="data", default=CalibrateConfig.data,
                help="calibration text: 'prose', 'code' or a text file")
    add_renamed(parser, "--calib-tokens", "--tokens", dest="tokens", type=int,
                default=CalibrateConfig.tokens, help="calibration tokens (at least 16)")
    parser.add_argument("--chunk", type=int, default=CalibrateConfig.chunk,
                        help="tokens per forward pass while the moments are collected")
    parser.add_argument("--block", type=int, default=None,
                        help="channels per transform block, a power of two dividing the head "
                             "dim (default: the head dim)")
    parser.add_argument("--damping", type=float, default=CalibrateConfig.damping,
                        help="λ as a share of the mean diagonal of each second moment")
    parser.set_defaults(run=lambda args: run_calibrate(config_from(CalibrateConfig, args)))


def run_calibrate(config: CalibrateConfig, loaded: LoadedModel | None = None) -> TransformSet:
    if not isinstance(config.tokens, int) or config.tokens < 16:
        raise ValueError(f"tokens={config.tokens!r} is invalid; expected an integer >= 16")
    if not config.damping > 0:
        raise ValueError(f"damping={config.damping!r} is invalid; expected a number > 0")
    loaded, ids = load_inputs(config, config.tokens, loaded)
    spec = make_cache(loaded.model, "full").spec
    block = config.block or spec.head_dim
    if spec.head_dim % block or block & (block - 1):
        raise ValueError(f"block={block} must be a power of two dividing the head dim "
                         f"{spec.head_dim}")
    moments = collect_moments(loaded.model, ids, config.chunk)
    matrices = compute_transforms(loaded.model, moments, block, config.damping)
    meta = {"model": spec.name, "layers": str(spec.n_layers), "kv_heads": str(spec.n_kv_heads),
            "head_dim": str(spec.head_dim), "block": str(block), "damping": str(config.damping),
            "data": config.data, "tokens": str(config.tokens)}
    transforms = TransformSet(matrices["keys"], matrices["values"], meta)
    rows = [{"side": side, "kind": kind,
             "condition_median": torch.linalg.cond(t).median().item()}
            for side in ("keys", "values") for kind, t in matrices[side].items()]
    if config.out:
        Path(config.out).mkdir(parents=True, exist_ok=True)
        path = save_transforms(Path(config.out) / "transforms.safetensors", transforms)
        console.print(f"wrote {path}")
    finish("calibrate", config, loaded, rows, f"{config.data} · {config.tokens} tokens · block "
           f"{block} · damping {config.damping}", {"side": "side", "kind": "kind",
                                                   "condition_median": "median cond(T)"},
           transforms=transforms.meta)
    return transforms
