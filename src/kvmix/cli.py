"""The ``kvmix`` command line: one subcommand per job, each a thin layer over the library."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from kvmix.commands.bench import BenchConfig, run_bench
from kvmix.evaluation.calibration import CalibrateConfig, run_calibrate
from kvmix.commands.compare import CompareConfig, run_compare
from kvmix.commands.criteria import CriteriaConfig, run_criteria
from kvmix.commands.keyfirst import KeyfirstConfig, run_keyfirst
from kvmix.methods import method_classes, parameters, presets, split_methods
from kvmix.commands.norms import NormsConfig, run_norms
from kvmix.commands.pairscore import PairscoreConfig, run_pairscore
from kvmix.commands.recon import ReconConfig, run_recon
from kvmix.commands.sweep import SweepConfig, run_sweep
from kvmix.commands.transforms import TransformsConfig, run_export, run_transforms


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        args.run(args)
    except ValueError as error:
        parser.exit(2, f"kvmix {args.command}: error: {error}\n")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmix", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="memory, perplexity, token KL and time per method")
    defaults = CompareConfig()
    _common(compare, defaults)
    _lengths(compare, CompareConfig)
    compare.set_defaults(run=_compare)
    bench = sub.add_parser("bench", help="decode tokens/s of each method after a prompt")
    _common(bench, BenchConfig())
    bench.add_argument("--prompt", type=int, default=BenchConfig.prompt, help="prompt tokens")
    bench.add_argument("--new-tokens", type=int, default=BenchConfig.new_tokens,
                       help="timed greedy decode steps")
    bench.set_defaults(run=_bench)
    criteria = sub.add_parser("criteria", help="PN-Mix selection criteria at one bit budget")
    _common(criteria, CriteriaConfig(), methods=False)
    criteria.add_argument("--base", default=CriteriaConfig.base,
                          help="PN-Mix method whose criterion is varied (e.g. pnmix1)")
    criteria.add_argument("--criteria", default=",".join(CriteriaConfig().criteria),
                          help="comma-separated criteria")
    _lengths(criteria, CriteriaConfig)
    criteria.add_argument("--queries", type=int, default=CriteriaConfig.queries,
                          help="decode queries for attention KL")
    criteria.set_defaults(run=_criteria)
    pairscore = sub.add_parser("pairscore", help="separable vs causal PN-Mix pair score")
    _common(pairscore, PairscoreConfig(), methods=False)
    pairscore.add_argument("--context", type=int, default=PairscoreConfig.context)
    pairscore.add_argument("--ratio", type=float, default=PairscoreConfig.ratio,
                           help="share of pairs for the top-k overlap")
    pairscore.set_defaults(run=_pairscore)
    sweep = sub.add_parser("sweep", help="bit-rate Pareto curve of PN-Mix and Kitty (+ KIVI)")
    _common(sweep, SweepConfig(), methods=False)
    sweep.add_argument("--budgets", default=",".join(map(str, SweepConfig().budgets)),
                       help="average key bits to hit")
    sweep.add_argument("--families", default=",".join(SweepConfig().families))
    sweep.add_argument("--group", type=int, default=SweepConfig.group)
    sweep.add_argument("--no-kivi", dest="kivi", action="store_false",
                       help="leave out KIVI's native points")
    _lengths(sweep, SweepConfig)
    sweep.set_defaults(run=_sweep)
    norms = sub.add_parser("norms", help="spectral/Frobenius norms of W_K vs W_V per layer")
    _common(norms, NormsConfig(), methods=False)
    norms.set_defaults(run=lambda args: run_norms(_config(NormsConfig, args)))
    keyfirst = sub.add_parser("keyfirst", help="K2V4 vs K4V2 vs K4V4 vs K2V2, rotations, groups")
    _common(keyfirst, KeyfirstConfig(), methods=False)
    _lengths(keyfirst, KeyfirstConfig)
    keyfirst.set_defaults(run=lambda args: run_keyfirst(_config(KeyfirstConfig, args)))
    recon = sub.add_parser("recon", help="key vs value reconstruction error at equal bits")
    _common(recon, ReconConfig(), methods=False)
    recon.add_argument("--bits", default="1,2,3,4", help="comma-separated widths")
    recon.add_argument("--context", type=int, default=ReconConfig.context)
    recon.add_argument("--queries", type=int, default=ReconConfig.queries)
    recon.add_argument("--group", type=int, default=ReconConfig.group)
    recon.add_argument("--value-group", type=int, default=ReconConfig.value_group)
    recon.set_defaults(run=lambda args: run_recon(_config(ReconConfig, args)))
    calibrate = sub.add_parser("calibrate", help="WUSH-KV transforms from calibration text")
    _common(calibrate, CalibrateConfig(), methods=False)
    calibrate.add_argument("--tokens", type=int, default=CalibrateConfig.tokens)
    calibrate.add_argument("--chunk", type=int, default=CalibrateConfig.chunk)
    calibrate.add_argument("--block", type=int, default=None, help="default: the head dim")
    calibrate.add_argument("--damping", type=float, default=CalibrateConfig.damping,
                           help="λ as a share of the mean diagonal of each second moment")
    calibrate.set_defaults(run=lambda args: run_calibrate(_config(CalibrateConfig, args)))
    transforms = sub.add_parser("transforms", help="WUSH-KV transforms × quantizers at equal bits")
    _common(transforms, TransformsConfig(), methods=False)
    transforms.add_argument("--transforms", default="", help="file from kvmix calibrate "
                            "(default: calibrate on --calib-data first)")
    transforms.add_argument("--calib-data", default=TransformsConfig.calib_data)
    transforms.add_argument("--calib-tokens", type=int, default=TransformsConfig.calib_tokens)
    transforms.add_argument("--bits", type=int, default=TransformsConfig.bits)
    transforms.add_argument("--queries", type=int, default=TransformsConfig.queries)
    _lengths(transforms, TransformsConfig)
    transforms.set_defaults(run=lambda args: run_transforms(_config(TransformsConfig, args)))
    export = sub.add_parser("export", help="folded model + WUSH right-multipliers for serving")
    export.add_argument("--model", default=CompareConfig.model)
    export.add_argument("--dtype", default="auto")
    export.add_argument("--transforms", required=True)
    export.add_argument("--transform", default="wush")
    export.add_argument("--out", required=True)
    export.set_defaults(run=_export)
    listing = sub.add_parser("methods", help="list methods, presets, parameters, bit formulas")
    listing.set_defaults(run=_methods)
    return parser


def _common(parser: argparse.ArgumentParser, defaults, methods: bool = True) -> None:
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    parser.add_argument("--data", default=defaults.data, help="'prose', 'code' or a text file")
    if methods:
        parser.add_argument("--methods", default=",".join(defaults.methods),
                            help="comma-separated methods with overrides, e.g. "
                                 "full,kivi2,kxvy:key_bits=4,value_bits=2")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto (float32 on CPU), float32, float16, bfloat16")
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--out", default=None, help="folder for results.json")


def _lengths(parser: argparse.ArgumentParser, cls) -> None:
    parser.add_argument("--context", type=int, default=cls.context,
                        help="prompt tokens prefilled before scoring")
    parser.add_argument("--eval-tokens", type=int, default=cls.eval_tokens,
                        help="tokens scored by decoding over the cache")
    parser.add_argument("--chunk", type=int, default=cls.chunk,
                        help="tokens per teacher-forced decode step (1 = exact decode)")


def _config(cls, args: argparse.Namespace):
    values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
    if "methods" in values:
        values["methods"] = split_methods(args.methods)
    for name in ("criteria", "families"):
        if name in values:
            values[name] = [c.strip() for c in values[name].split(",") if c.strip()]
    if isinstance(values.get("bits"), str):
        values["bits"] = [int(b) for b in values["bits"].split(",") if b.strip()]
    if "budgets" in values:
        values["budgets"] = [float(b) for b in values["budgets"].split(",") if b.strip()]
    return cls(**values)


def _sweep(args: argparse.Namespace) -> None:
    run_sweep(_config(SweepConfig, args))


def _criteria(args: argparse.Namespace) -> None:
    run_criteria(_config(CriteriaConfig, args))


def _pairscore(args: argparse.Namespace) -> None:
    run_pairscore(_config(PairscoreConfig, args))


def _compare(args: argparse.Namespace) -> None:
    run_compare(_config(CompareConfig, args))


def _bench(args: argparse.Namespace) -> None:
    run_bench(_config(BenchConfig, args))


def _methods(args: argparse.Namespace) -> None:
    from kvmix.evaluation.report import print_table

    rows = [{"method": name, "about": cls.summary, "bits": cls.describe(),
             "parameters": ", ".join(f"{k}={_show(v)}" for k, v in parameters(cls).items())}
            for name, cls in method_classes().items()]
    rows += [{"method": name, "about": f"preset of {cls.name}",
              "parameters": ", ".join(f"{k}={v}" for k, v in params.items())}
             for name, (cls, params) in presets().items()]
    print_table("kvmix methods", rows, {"method": "method", "about": "about",
                                        "bits": "bits per element", "parameters": "parameters"})


def _show(value) -> str:
    return "/".join(map(str, value)) if isinstance(value, tuple) else str(value)



def _export(args: argparse.Namespace) -> None:
    from kvmix.models.loading import load_model

    run_export(args.transforms, args.transform, args.out, load_model(args.model, args.dtype))


if __name__ == "__main__":
    sys.exit(main())
