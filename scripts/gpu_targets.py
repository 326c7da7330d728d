"""The GPU decode step's targets (shape 32:8 × 128, float16), each with the figure
``scripts/gpu_check.sh`` measured in OUT_DIR, met or not; a figure that is missing says so.
Usage: python scripts/gpu_targets.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

RATIO = 2.37  # PN-Mix's per-GPU throughput at equal memory


def load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def kernel_targets(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    found = {(r["method"], r["context"], r["batch"]): r for r in rows}
    out = []
    for method in ("kivi2", "pnmix1"):
        row = found.get((method, 16384, 1))
        out.append((f"{method} 16K batch 1: µs per layer step <= SDPA's",
                    *_ratio(row, lambda r: r["vs_sdpa"] >= 1,
                            lambda r: f"{r['us_per_step']:.0f} µs, {r['vs_sdpa']:.2f}x SDPA")))
        for batch in (8, 32):
            row = found.get((method, 65536, batch))
            out.append((f"{method} 64K batch {batch}: <= 0.5x SDPA's time, >= 40% of copy "
                        "bandwidth", *_ratio(
                            row, lambda r: r["vs_sdpa"] >= 2 and r["of_limit"] >= 0.4,
                            lambda r: f"{r['us_per_step']:.0f} µs, {r['vs_sdpa']:.2f}x SDPA, "
                                      f"{100 * r['of_limit']:.0f}% of copy bandwidth")))
    return out


def step_targets(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    out = []
    for r in rows:
        case = f"{r['method']} {r['context'] // 1024}K batch {r['batch']}"
        out.append((f"{case}: no sync inside a step", r["sync"], r["sync"] == "ok"))
        out.append((f"{case}: host µs per layer step without graphs <= 50",
                    f"{r['host_us']:.0f} µs (device done: {r['device_us']:.0f} µs)",
                    r["host_us"] <= 50))
        diff = r.get("captured_max_abs_diff")
        out.append((f"{case}: captured == eager across sealed pages",
                    r.get("captured", f"max |diff| {diff} over {r.get('replays')} replays, "
                          f"{r.get('pages_sealed_between_replays')} pages sealed, "
                          f"replay {r.get('graph_us') or 0:.0f} µs"),
                    diff == 0 and r.get("pages_sealed_between_replays", 0) > 0))
    return out


def served_targets(rows: list[dict]) -> list[tuple[str, str, bool | None]]:
    out = []
    for r in rows[1:]:
        ratio = r.get("vs_transformers_graphs")
        figure = r.get("error") or (f"{r['output_tokens_per_s']:.0f} tok/s, {ratio:.2f}x"
                                    if ratio else "no ratio: " + json.dumps(rows[0]))
        out.append((f"{r['server']} served >= {RATIO}x transformers' paged continuous batching "
                    "with CUDA graphs", figure, None if ratio is None else ratio >= RATIO))
    return out


def _ratio(row, test, text):
    return ("unmeasured (no row)", None) if row is None else (text(row), test(row))


def main() -> None:
    out = Path(sys.argv[1])
    kernels = load(out / "shape-8b-fp16" / "results.json")
    step = load(out / "step" / "step.json")
    served = load(out / "throughput" / "served.json")
    targets = kernel_targets(kernels["rows"]) if kernels else [
        ("kernel targets", "unmeasured: no shape-8b-fp16/results.json", None)]
    targets += step_targets(step["rows"]) if step else [
        ("step targets", "unmeasured: no step/step.json", None)]
    targets += served_targets(served) if served else [
        ("end-to-end target", "unmeasured: no throughput/served.json", None)]
    for name, figure, met in targets:
        verdict = {True: "met", False: "NOT met", None: "unmeasured"}[met]
        print(f"{verdict:>10}  {name}: {figure}")


if __name__ == "__main__":
    main()
