"""``kvmix export``: what serving needs. ``--plan METHOD``: a ``kv_plan.json`` (the method's
widths per layer, layout, transforms' checksum, the model's fingerprint) with the nearest setting
of each engine and their flags, and the token KL of the plan and of the engine settings kvmix
simulates, measured on the same text (``kvmix.engines.kv_plan``). ``--transforms``: WUSH-KV's
serving artifacts —
The model with values folded (``save_pretrained``) and one safetensors file of the
right-multipliers per (layer, KV head, block), float64, each [L, H, D/block, block, block]:
``k_right = T_kᵀ`` (k' = k·k_right), ``q_right = T_k⁻¹`` (q' = q·q_right), ``v_right = T_vᵀ``
(v' = v·v_right, what the folded W_V produces) and ``o_right = T_v⁻ᵀ`` (o = o'·o_right, what the
folded W_O undoes), so ``q_right·k_rightᵀ = I`` and ``v_right·o_right = I``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kvmix.commands.args import add_length_arguments, add_renamed
from kvmix.core.transforms import KINDS, save_multipliers
from kvmix.engines.formats import CURRENT, parse_versions
from kvmix.engines.kv_plan import make_plan, measured_kl, save_plan, simulated
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.evaluation.scoring import check_lengths, score_methods, token_kl
from kvmix.jobs.report import console, print_table
from kvmix.methods import parse_method
from kvmix.models.loading import DEFAULT_MODEL, LoadedModel, drop_gguf_marker, load_model
from kvmix.runtime.folding import CONFIG_KEY, prepare_model


def run_export(transforms: str, transform: str, model_out: str, loaded: LoadedModel,
               inplace: bool = False) -> dict[str, Path]:
    """Save the folded model and the right-multipliers (see the module docstring); ``inplace``
    folds ``loaded``'s model itself (the CLI's, loaded for this export only) instead of a
    copy."""
    method = parse_method(f"wush:transforms={transforms},transform={transform}")
    folded = prepare_model(loaded.model, method, inplace=inplace)
    out = Path(model_out)
    out.mkdir(parents=True, exist_ok=True)
    drop_gguf_marker(folded)
    setattr(folded.config, CONFIG_KEY, {"id": method.fold_id, "model": method.meta["model"]})
    folded.save_pretrained(out / "model")
    loaded.tokenizer.save_pretrained(out / "model")
    transforms = method.transform_set()
    path = save_multipliers(out / "right_multipliers.safetensors", transforms, transform)
    console.print(f"wrote {out / 'model'} and {path}")
    return {"model": out / "model", "multipliers": path}


@dataclass
class ExportPlanConfig(JobConfig):
    """What ``export --plan`` reads; the KL is measured on ``context + eval_tokens`` tokens."""

    method: str = "pnmix1"
    context: int = 512
    eval_tokens: int = 128
    chunk: int = 1
    measure: bool = True
    engine_version: str = ""  # engine=version[,...]: other known releases than the current


def run_export_plan(config: ExportPlanConfig, loaded: LoadedModel | None = None) -> dict:
    """Write ``out/kv_plan.json`` (see the module docstring); returns the plan."""
    if not config.out:
        raise ValueError("out is required: the folder kv_plan.json is written to")
    check_lengths(config.context, config.eval_tokens, config.chunk)
    parse_method(config.method)  # a bad method string fails before the model loads
    versions = parse_versions(config.engine_version)  # so does an unknown engine release
    loaded, ids = load_inputs(config, config.context + config.eval_tokens + 1, loaded)
    plan = make_plan(loaded, config.method, versions)
    if config.measure:
        methods = simulated(plan)
        scored = score_methods(loaded, ids, ["full", *methods], config.context, config.chunk,
                               backend=config.backend)
        measured_kl(plan, {m: token_kl(scored["full"].logprobs, scored[m].logprobs)
                           for m in methods})
        plan["measured_on"] = {"data": config.data, "context": config.context,
                               "eval_tokens": config.eval_tokens}
    rows = [{"engine": "kvmix", "setting": config.method, "flags": "",
             "kl": plan.get("kl"), "cannot": ""}]
    rows += [{"engine": f"{name} {s['release']}", "setting": s["setting"],
              "flags": " ".join(s["flags"]), "kl": s["kl"], "fidelity": s["fidelity"],
              "cannot": "; ".join(s["cannot"])}
             for name, s in plan["engines"].items()]
    print_table(f"kvmix export --plan · {loaded.name} · {config.method}", rows,
                {"engine": "engine", "setting": "setting", "flags": "flags", "kl": "token KL",
                 "fidelity": "measured or from the source", "cannot": "cannot express"})
    console.print(f"wrote {save_plan(config.out, plan)}")
    return plan


def add_parser(commands) -> None:
    parser = commands.add_parser("export", help="a KV plan with engine settings (--plan), or "
                                                "WUSH's folded model + right-multipliers")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    parser.add_argument("--dtype", default="auto",
                        help="auto (float32 on CPU), float32, float16, bfloat16")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--plan", metavar="METHOD", help="write kv_plan.json for this method")
    which.add_argument("--transforms", metavar="FILE",
                       help="WUSH transforms file (kvmix calibrate): fold it into the model")
    add_renamed(parser, "--kind", "--transform", default="wush", choices=KINDS,
                help="--transforms: which transform of the file is folded")
    parser.add_argument("--data", default="prose", help="--plan: text the KL is measured on")
    add_length_arguments(parser, ExportPlanConfig)
    parser.add_argument("--no-measure", action="store_true", help="--plan: skip the KL")
    parser.add_argument("--engine-version", default="", metavar="ENGINE=VERSION[,...]",
                        help="--plan: target another known engine release (default: "
                             + ", ".join(f"{e} {v}" for e, v in CURRENT.items()) + ")")
    parser.add_argument("--out", required=True,
                        help="folder for kv_plan.json, or for the folded model and multipliers")
    parser.set_defaults(run=_run)


def _run(args) -> None:
    if args.plan:
        run_export_plan(ExportPlanConfig(model=args.model, data=args.data, dtype=args.dtype,
                                  out=args.out, method=args.plan, context=args.context,
                                  eval_tokens=args.eval_tokens, chunk=args.chunk,
                                  measure=not args.no_measure,
                                  engine_version=args.engine_version))
    else:
        run_export(args.transforms, args.kind, args.out, load_model(args.model, args.dtype),
                   inplace=True)
