"""``kvmix plan``: will it fit, how big a batch, how long a generation, and how fast (an
estimate) — for a model config and an accelerator (``--hardware``), per KV method (see
kvmix.capacity).

``--calibrate BENCH_JSON`` sets the roofline beside measurements instead: it measures this
machine's copy bandwidth and matmul FLOP/s and predicts the decode time of every row of a
``kvmix bench`` results.json (the default model, batch 1), with the error of each prediction.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvmix.bench.resources import matmul_flops, memory_bandwidth
from kvmix.capacity import (
    DEFAULT_OVERHEAD,
    DEVICES,
    WEIGHT_BITS,
    Device,
    bound,
    device,
    max_batch,
    max_tokens,
    parse_memory,
    planned,
    roofline,
)
from kvmix.commands.args import add_renamed, config_from
from kvmix.jobs.plots import capacity_plot
from kvmix.jobs.report import console, print_table, write_results
from kvmix.models.catalog import architecture, bundled
from kvmix.models.loading import DTYPES

COLUMNS = {"method": "method", "key_bits": "K bits", "value_bits": "V bits",
           "kv_gb": "KV GB", "weight_gb": "weights GB", "total_gb": "total GB", "fits": "fits",
           "max_batch": "max batch", "max_tokens": "max tokens", "est_tokens_per_s": "est tok/s",
           "est_tokens_per_s_max_batch": "est tok/s @max batch",
           "est_speedup_vs_full": "est × full (equal memory)"}
CALIBRATION = {"method": "method", "backend": "backend", "prompt": "prompt",
               "measured_ms": "measured ms", "predicted_ms": "roofline ms", "error": "error"}


@dataclass
class PlanConfig:
    model: str = "qwen3-8b"
    hardware: str = "a100-40gb"
    memory: str | None = None  # overrides the hardware's memory, e.g. 40GB or 40GiB
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2", "pnmix1"])
    batch: int = 1
    prompt_tokens: int = 0
    new_tokens: int = 4096  # generated tokens; the cache holds prompt_tokens + new_tokens
    weight_bits: int = 16
    kv_dtype: str = "float16"  # of the sink, the residual and the `full` method
    overhead: str = "1.5GiB"
    calibrate: str | None = None
    out: str | None = None


def add_parser(commands) -> None:
    parser = commands.add_parser("plan", help="will it fit: batch, length, memory, est. speed")
    parser.add_argument("--model", default=PlanConfig.model,
                        help=f"bundled ({', '.join(bundled())}) or a config.json")
    add_renamed(parser, "--hardware", "--device", default=PlanConfig.hardware,
                help=f"the accelerator planned for: {', '.join(DEVICES)} or mac-<N>gb")
    parser.add_argument("--memory", default=None,
                        help="a memory size instead of --hardware's, e.g. 40GB or 24GiB (no "
                             "speed estimate)")
    parser.add_argument("--methods", default=",".join(PlanConfig().methods),
                        help="comma-separated methods with overrides, e.g. full,kivi2,pnmix1")
    parser.add_argument("--batch", type=int, default=PlanConfig.batch,
                        help="sequences held at once")
    add_renamed(parser, "--prompt-tokens", "--prompt", type=int,
                default=PlanConfig.prompt_tokens, help="prompt tokens of each sequence")
    add_renamed(parser, "--new-tokens", "--tokens", type=int, default=PlanConfig.new_tokens,
                help="generated tokens of each sequence (the cache holds prompt + new tokens)")
    parser.add_argument("--weight-bits", type=int, default=PlanConfig.weight_bits,
                        help="16, 8 or 4 (4.25 with group scales)")
    parser.add_argument("--kv-dtype", default=PlanConfig.kv_dtype,
                        help=f"float dtype of the sink, the residual and full's cache "
                             f"({', '.join(DTYPES)})")
    parser.add_argument("--overhead", default=PlanConfig.overhead,
                        help="framework context, activations and reserve")
    parser.add_argument("--calibrate", default=None,
                        help="a kvmix bench results.json: roofline vs measured on this machine")
    parser.add_argument("--out", default=None, help="folder for results.json and capacity.png")
    parser.set_defaults(run=lambda args: run_plan(config_from(PlanConfig, args)))


def run_plan(config: PlanConfig) -> list[dict]:
    if config.calibrate:
        return run_calibration(config)
    _check_sizes(config)
    if config.weight_bits not in WEIGHT_BITS:
        raise ValueError(f"weight_bits={config.weight_bits} is invalid; valid: 16, 8, 4")
    target = _target(config)
    arch = architecture(config.model)
    dtype = _dtype(config.kv_dtype)
    overhead = (parse_memory(config.overhead, "overhead", allow_zero=True) if config.overhead
                else DEFAULT_OVERHEAD)
    methods = {text: bound(text, arch) for text in config.methods}
    context = config.prompt_tokens + config.new_tokens
    _check_room(arch, config, target, overhead)
    rows = [_row(text, method, arch, config, target, dtype, overhead, context)
            for text, method in methods.items()]
    _speedups(rows)
    title = (f"kvmix plan · {arch.name} · {target.name} ({target.memory / 1e9:.1f} GB) · batch "
             f"{config.batch} · {config.prompt_tokens} + {config.new_tokens} tokens · weights "
             f"{config.weight_bits}-bit · KV {config.kv_dtype} · overhead {overhead / 1e9:.2f} GB")
    print_table(title, rows, COLUMNS)
    if config.out:
        plot = capacity_plot(Path(config.out) / "capacity.png", _curves(methods, arch, config,
                             dtype, overhead), target.memory / 1e9, f"{arch.name}, batch "
                             f"{config.batch}, prompt {config.prompt_tokens}", target.name)
        path = write_results(config.out, "plan", config, rows, (title, COLUMNS),
                             device=vars(target),
                             architecture=vars(arch) | {"parameters": arch.parameters},
                             plots=[str(plot)])
        console.print(f"wrote {path}")
    return rows


def _row(text, method, arch, config, target: Device, dtype, overhead, context) -> dict:
    args = (config.weight_bits, dtype, overhead)
    plan = planned(method, arch, config.batch, context, *args)
    batch_max = max_batch(method, arch, context, *args, target.memory)
    at_max = planned(method, arch, max(batch_max, 1), context, *args)
    key_bits, value_bits = method.bits(0, dtype)
    return {"method": text, "key_bits": key_bits, "value_bits": value_bits,
            "kv_bytes": plan.kv_bytes, "weight_bytes": plan.weights, "overhead_bytes": overhead,
            "total_bytes": plan.total, "kv_gb": plan.kv_bytes / 1e9,
            "weight_gb": plan.weights / 1e9, "total_gb": plan.total / 1e9,
            "fits": plan.total <= target.memory, "max_batch": batch_max,
            "max_tokens": max_tokens(method, arch, config.batch, config.prompt_tokens, *args,
                                     target.memory),
            "kv_breakdown": plan.kv,
            "est_tokens_per_s": roofline(plan, arch, config.batch, context, target.bandwidth,
                                         target.flops) if plan.total <= target.memory else 0.0,
            "est_tokens_per_s_max_batch": roofline(at_max, arch, batch_max, context,
                                                   target.bandwidth, target.flops)}


def _check_room(arch, config: PlanConfig, target: Device, overhead: float) -> None:
    weights = arch.parameters * WEIGHT_BITS[config.weight_bits] / 8
    if weights + overhead >= target.memory:
        raise ValueError(f"the weights ({weights / 1e9:.1f} GB at {config.weight_bits} bits) and "
                         f"overhead ({overhead / 1e9:.1f} GB) alone exceed the memory "
                         f"({target.memory / 1e9:.1f} GB): not even one token fits")


def _speedups(rows: list[dict]) -> None:
    """Tokens/s at each method's largest batch over float16's at its own (equal memory)."""
    full = next((r for r in rows if r["method"] == "full"), None)
    for row in rows:
        reference = full["est_tokens_per_s_max_batch"] if full else 0
        mine = row["est_tokens_per_s_max_batch"]
        row["est_speedup_vs_full"] = mine / reference if reference and mine is not None else None


def _curves(methods, arch, config, dtype, overhead) -> dict[str, list[tuple[float, float]]]:
    """Total GB against generated tokens, per method, at the configured batch."""
    top = max(2 * (config.prompt_tokens + config.new_tokens), 1024)
    points = [round(top * i / 40) for i in range(41)]
    return {text: [(n, planned(method, arch, config.batch, config.prompt_tokens + n,
                               config.weight_bits, dtype, overhead).total / 1e9) for n in points]
            for text, method in methods.items()}


def _check_sizes(config: PlanConfig) -> None:
    for name, least in (("batch", 1), ("prompt_tokens", 0), ("new_tokens", 1)):
        value = getattr(config, name)
        if not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} is invalid; expected an integer >= {least}")


def _target(config: PlanConfig) -> Device:
    if config.memory:
        return Device(f"{config.memory} memory", parse_memory(config.memory), 0.0, 0.0)
    try:
        return device(config.hardware)
    except ValueError:
        raise ValueError(f"hardware={config.hardware!r} is unknown; valid: "
                         f"{', '.join(DEVICES)}, mac-<N>gb (or give --memory)") from None


def _dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"kv_dtype={name!r} is invalid; valid: {', '.join(DTYPES)}")
    return DTYPES[name]


def run_calibration(config: PlanConfig) -> list[dict]:
    """Roofline predictions for the rows of a kvmix bench run, beside their measurements."""
    bench = json.loads(Path(config.calibrate).read_text())
    bandwidth, flops = memory_bandwidth(), matmul_flops()
    arch = architecture("smollm2")
    rows = []
    for measured in bench["rows"]:
        method = "full" if measured["method"] == "dynamic" else measured["method"]
        if measured["backend"] == "-" and measured["method"] != "dynamic":
            continue  # transformers' quantized caches: no kvmix formula
        context = measured["prompt"] + bench["config"]["warmup"] + bench["config"]["new_tokens"]
        plan = planned(bound(method, arch), arch, 1, context, 32, torch.float32, 0.0)
        predicted = 1000 / roofline(plan, arch, 1, context, bandwidth, flops)
        rows.append({"method": measured["method"], "backend": measured["backend"],
                     "prompt": measured["prompt"], "measured_ms": measured["ms_per_token"],
                     "predicted_ms": predicted,
                     "error": predicted / measured["ms_per_token"] - 1})
    print_table(f"kvmix plan --calibrate · this machine: copy {bandwidth / 1e9:.1f} GB/s, "
                f"matmul {flops / 1e9:.0f} GFLOP/s (float32)", rows, CALIBRATION)
    if config.out:
        path = write_results(config.out, "plan-calibrate", config, rows,
                             measured={"bandwidth": bandwidth, "flops": flops})
        console.print(f"wrote {path}")
    return rows
