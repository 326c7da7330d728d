"""``kvmix keyfirst``: the key-priority study in one command (docs/guide/evaluation.md, Studies of
the papers).

K2V4 vs K4V2 vs K4V4 vs K2V2 (per-channel keys, per-token values, KIVI's residual of 128), the
rotated variants (Hadamard on keys only, values only, both), and group sizes (key group 32 vs
128; value group 32 vs 64, as a value group cannot exceed the head dim, 64 on the default model,
where the paper's 128-dim heads allowed 64 vs 128): token KL, perplexity and the bytes each
cache holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvmix.commands.args import add_job_arguments, add_length_arguments, config_from
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.evaluation.scoring import check_lengths, score_methods, summary
from kvmix.jobs.plots import grouped_bars
from kvmix.jobs.report import finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

STUDY = {
    "K4V4": "kxvy:key_bits=4,value_bits=4",
    "K4V2": "kxvy:key_bits=4,value_bits=2",
    "K2V4": "kxvy:key_bits=2,value_bits=4",
    "K2V2": "kxvy:key_bits=2,value_bits=2",
    "K4V2 rotate keys": "kxvy:key_bits=4,value_bits=2,rotate=keys",
    "K2V4 rotate keys": "kxvy:key_bits=2,value_bits=4,rotate=keys",
    "K4V2 rotate values": "kxvy:key_bits=4,value_bits=2,rotate=values",
    "K4V2 rotate both": "kxvy:key_bits=4,value_bits=2,rotate=both",
    "K4V2 key group 128": "kxvy:key_bits=4,value_bits=2,group=128",
    "K2V2 key group 128": "kxvy:key_bits=2,value_bits=2,group=128",
    "K4V2 value group 64": "kxvy:key_bits=4,value_bits=2,value_group=64",
}
COLUMNS = {"label": "setting", "key_bits": "K bits", "value_bits": "V bits", "nbytes": "bytes",
           "ratio_fp16": "/16-bit", "token_kl": "token KL", "ppl": "ppl"}


@dataclass
class KeyfirstConfig(JobConfig):
    settings: dict[str, str] = field(default_factory=lambda: dict(STUDY))
    context: int = 1024
    eval_tokens: int = 256
    chunk: int = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("keyfirst", help="K2V4 vs K4V2 vs K4V4 vs K2V2, rotations, groups")
    add_job_arguments(parser, KeyfirstConfig(), methods=False)
    add_length_arguments(parser, KeyfirstConfig)
    parser.set_defaults(run=lambda args: run_keyfirst(config_from(KeyfirstConfig, args)))


def run_keyfirst(config: KeyfirstConfig, loaded: LoadedModel | None = None) -> list[dict]:
    check_lengths(config.context, config.eval_tokens, config.chunk)
    for method in config.settings.values():
        parse_method(method)
    loaded, ids = load_inputs(config, config.context + config.eval_tokens + 1, loaded)
    scored = score_methods(loaded, ids, ["full", *config.settings.values()], config.context,
                           config.chunk, backend=config.backend)
    full = scored["full"]
    rows = []
    for label, method in config.settings.items():
        rows.append({"label": label, "method": method, **summary(scored[method], full)})
    plots = [str(_plot(config, rows))] if config.out else []
    finish("keyfirst", config, loaded, rows, f"{config.data} · context {config.context} · "
           f"full ppl {full.ppl:.4g}", COLUMNS, plots=plots)
    return rows


def _plot(config: KeyfirstConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    panels = {"token KL": {"token KL": [r["token_kl"] for r in rows]},
              "bytes / 16-bit": {"bytes / 16-bit": [r["ratio_fp16"] for r in rows]}}
    return grouped_bars(Path(config.out) / "keyfirst.png", panels, "setting",
                        "key-priority study", ticks=[r["label"] for r in rows])
