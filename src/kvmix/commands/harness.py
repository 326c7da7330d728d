"""``kvmix eval``: lm-evaluation-harness tasks over each method's cache (the ``eval`` extra),
tabulated per method, task and metric with the cache's peak bytes. Local tasks need no
download: ``kvmix_passkey`` and lm-eval's RULER ``niah_single_1`` / ``ruler_vt`` (sized with
the model's own tokenizer; RULER's lengths start at 4096). Hub tasks (gsm8k, longbench, ...)
run where the user has their datasets."""

from __future__ import annotations

import atexit
import shutil
import tempfile
from dataclasses import dataclass, field

from kvmix.commands.args import (
    add_grid_arguments,
    add_job_arguments,
    add_renamed,
    config_from,
)
from kvmix.evaluation.inputs import JobConfig, check_backend
from kvmix.jobs.grid import Grid, GridConfig, Worker, check_grid, merged
from kvmix.jobs.report import finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel

COLUMNS = {"method": "method", "task": "task", "metric": "metric", "value": "value",
           "nbytes": "cache bytes (peak)"}


@dataclass
class EvalConfig(GridConfig, JobConfig):
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2", "pnmix1"])
    tasks: list[str] = field(default_factory=lambda: ["kvmix_passkey"])
    limit: int | None = None
    prompt_tokens: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    chunk: int = 16


def add_parser(commands) -> None:
    parser = commands.add_parser("eval", help="lm-evaluation-harness tasks through each cache")
    add_job_arguments(parser, EvalConfig())
    parser.add_argument("--tasks", default=",".join(EvalConfig().tasks),
                        help="lm-eval task names; local: kvmix_passkey, niah_single_1, ruler_vt")
    parser.add_argument("--limit", type=int, default=None, help="documents per task")
    add_renamed(parser, "--prompt-tokens", "--lengths", default="1024,2048,4096",
                help="prompt lengths of the synthetic tasks (RULER: 4096 and up)")
    parser.add_argument("--chunk", type=int, default=EvalConfig.chunk,
                        help="continuation tokens per step through the cache (1 = decode)")
    add_grid_arguments(parser)
    parser.set_defaults(run=lambda args: run_eval(config_from(EvalConfig, args)))


def run_eval(config: EvalConfig, loaded: LoadedModel | None = None) -> list[dict]:
    """One cell per method (``jobs.grid``: here or on Ray, resumed from ``--out``)."""
    lm_eval, harness = _imports()
    _check(config)
    check_grid(config)
    unknown = [t for t in config.tasks if t not in _tasks(harness, config).all_tasks]
    if unknown:
        raise ValueError(f"tasks={','.join(unknown)} unknown; valid local ones: "
                         f"{', '.join(harness.LOCAL_TASKS)} (or any lm-eval task whose dataset "
                         "you have)")
    outcomes, model = Grid("eval", config, eval_cell, shared=config).run(
        list(config.methods), Worker.holding(loaded, config))
    rows = merged(outcomes)
    finish("eval", config, model, rows, f"{', '.join(config.tasks)} · limit {config.limit}",
           COLUMNS, uses_data=False, lm_eval_version=lm_eval.__version__)
    return rows


def eval_cell(worker: Worker, config: EvalConfig, method: str) -> list[dict]:
    """One method through every task."""
    lm_eval, harness = _imports()
    loaded = worker.loaded
    manager = worker.memo("tasks", lambda: _tasks(harness, config, loaded.tokenizer))
    lm = harness.KVMixLM(loaded, method, config.backend, config.chunk)
    results = lm_eval.simple_evaluate(model=lm, tasks=config.tasks, limit=config.limit,
                                      task_manager=manager, bootstrap_iters=0,
                                      log_samples=False)
    return [{"method": method, "task": task, "metric": metric, "value": value,
             "nbytes": lm.peak_nbytes}
            for task, metrics in results["results"].items()
            for metric, value in _metrics(metrics)]


def _tasks(harness, config: EvalConfig, tokenizer=None):
    """lm-eval's task manager with kvmix's local tasks; the synthetic ones size their prompts
    with ``tokenizer`` (saved where they read it)."""
    folder = tempfile.mkdtemp(prefix="kvmix-tokenizer-")
    atexit.register(shutil.rmtree, folder, True)  # read lazily while tasks build: kept till exit
    manager = harness.task_manager(folder, config.prompt_tokens)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return manager


def _imports():
    try:
        import lm_eval

        from kvmix.evaluation import harness
    except ImportError as error:
        raise ValueError(f"kvmix eval needs lm-evaluation-harness ({error.name} is missing): "
                         "pip install 'kvmix[eval]'") from None
    return lm_eval, harness


def _check(config: EvalConfig) -> None:
    if config.limit is not None and config.limit < 1:
        raise ValueError(f"limit={config.limit} is invalid; expected an integer >= 1")
    if config.chunk < 1:
        raise ValueError(f"chunk={config.chunk} is invalid; expected an integer >= 1")
    if not config.tasks:
        raise ValueError("tasks is empty; name at least one task")
    for length in config.prompt_tokens:
        if length < 64:
            raise ValueError(f"prompt_tokens={length} is invalid; expected >= 64 tokens")
    check_backend(config.backend)
    for method in config.methods:
        parse_method(method)


def _metrics(metrics: dict):
    """(name, value) of a task's numeric scores; RULER marks lengths it did not run with -1."""
    for key, value in metrics.items():
        name, _, _ = key.partition(",")
        if isinstance(value, int | float) and "stderr" not in name and value != -1:
            yield name, float(value)
