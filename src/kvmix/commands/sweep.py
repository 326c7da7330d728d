"""``kvmix sweep``: the bit-rate Pareto curve of PN-Mix and Kitty (docs/guide/evaluation.md, Studies
of the papers).

Both methods are set to average key bits of 3.0, 2.5, 2.25, 2.0 and 1.5 (group 128, so 0.25 bits
of float16 scale and minimum per element), with values fixed at 2 bits for every method:

* **pnmix** keeps its 3/1-bit planes and varies the share of high pairs:
  ``ratio = (bits - 1 - 32/group) / 2`` (3.0 → 0.875, 2.25 → 0.5, 1.5 → 0.125);
* **kitty** promotes channels from 2 to 4 bits while the budget allows
  (``ratio = (bits - 2 - 32/group) / 2``: 3.0 → 0.375, 2.5 → 0.125, 2.25 → 0), and below 2.25
  bits drops to 1-bit channels promoted to 2 bits (``ratio = bits - 1 - 32/group``:
  2.0 → 0.75, 1.5 → 0.25), its min-max quantizer unchanged;
* **kivi** at its native points, 2 and 4 key bits (groups of 32: 3.0 and 5.0 bits per element).

Measured key bits come from each cache (channel counts are whole numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmix.commands.args import (
    add_grid_arguments,
    add_job_arguments,
    add_length_arguments,
    config_from,
)
from kvmix.evaluation.inputs import JobConfig, check_inputs
from kvmix.evaluation.scoring import check_lengths, score, scored_inputs, summary
from kvmix.jobs.grid import Grid, GridConfig, Worker, check_grid, merged
from kvmix.jobs.plots import scatter_lines
from kvmix.jobs.report import finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

BUDGETS = (3.0, 2.5, 2.25, 2.0, 1.5)
FAMILIES = ("pnmix", "kitty")
KIVI_POINTS = ("kivi:key_bits=2,value_bits=2", "kivi:key_bits=4,value_bits=2")
COLUMNS = {"family": "method", "target_bits": "target", "key_bits": "K bits",
           "setting": "setting", "token_kl": "token KL", "ppl": "ppl"}


@dataclass
class SweepConfig(GridConfig, JobConfig):
    budgets: list[float] = field(default_factory=lambda: list(BUDGETS))
    families: list[str] = field(default_factory=lambda: list(FAMILIES))
    group: int = 128
    kivi: bool = True
    context: int = 2048
    eval_tokens: int = 256
    chunk: int = 1


def method_at(family: str, bits: float, group: int = 128) -> str:
    """The method string of ``family`` at ``bits`` average key bits (see the module docstring)."""
    spare = bits - 32 / group
    if family == "pnmix":
        ratio, extra = (spare - 1) / 2, ""
    elif family == "kitty" and spare >= 2:
        ratio, extra = (spare - 2) / 2, ""
    elif family == "kitty":
        ratio, extra = spare - 1, ",high_bits=2,low_bits=1"
    else:
        raise ValueError(f"family={family!r} is invalid; valid: {', '.join(FAMILIES)}")
    if not 0 <= ratio <= 1:
        raise ValueError(f"{family} cannot reach {bits} key bits with group={group}")
    return f"{family}:ratio={ratio:g},group={group}{extra}"


def add_parser(commands) -> None:
    parser = commands.add_parser("sweep", help="bit-rate Pareto curve of PN-Mix and Kitty (+ KIVI)")
    add_job_arguments(parser, SweepConfig(), methods=False)
    parser.add_argument("--budgets", default=",".join(map(str, SweepConfig().budgets)),
                        help="average key bits to hit")
    parser.add_argument("--families", default=",".join(SweepConfig().families),
                        help=f"methods swept over the budgets ({', '.join(FAMILIES)})")
    parser.add_argument("--group", type=int, default=SweepConfig.group,
                        help="tokens per key group (sets the bits of scales and minimums)")
    parser.add_argument("--no-kivi", dest="kivi", action="store_false",
                        help="leave out KIVI's native points")
    add_length_arguments(parser, SweepConfig)
    add_grid_arguments(parser)
    parser.set_defaults(run=lambda args: run_sweep(config_from(SweepConfig, args)))


def run_sweep(config: SweepConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """One cell per point (``jobs.grid``: here or on Ray, resumed from ``--out``)."""
    check_lengths(config.context, config.eval_tokens, config.chunk)
    check_inputs(config)
    check_grid(config)
    points = [(family, bits, method_at(family, bits, config.group))
              for family in config.families for bits in config.budgets]
    points += [("kivi", None, m) for m in KIVI_POINTS] if config.kivi else []
    for _, _, method in points:
        parse_method(method)
    grid = Grid("sweep", config, sweep_cell, shared=config)
    outcomes, model = grid.run(points, Worker.holding(loaded, config))
    rows = merged(outcomes)
    plots = [str(_plot(config, rows))] if config.out else []
    full = f"full ppl {rows[0]['ppl'] - rows[0]['delta_ppl']:.4g}" if rows else "no point"
    finish("sweep", config, model, rows, f"{config.data} · context {config.context} · {full}",
           COLUMNS, plots=plots)
    return rows


def sweep_cell(worker: Worker, config: SweepConfig, point: tuple) -> list[dict]:
    """One point of the curve scored against ``full`` (once per worker)."""
    family, target, method = point
    loaded, ids, full = scored_inputs(worker, config)
    scored = score(loaded.model, ids, method, config.context, config.chunk,
                   backend=config.backend)
    return [{"family": family, "target_bits": target, "setting": method.partition(":")[2],
             "method": method, **summary(scored, full)}]


def _plot(config: SweepConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        series.setdefault(row["family"], []).append((row["key_bits"], row["token_kl"]))
    return scatter_lines(Path(config.out) / "pareto.png", series, "average key bits",
                         "token KL vs full (log)", "bit rate vs accuracy", log=True)
