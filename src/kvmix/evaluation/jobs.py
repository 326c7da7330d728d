"""Plumbing every command shares: load the model and tokens, score methods with a progress
bar, print the table and save ``results.json`` with the configuration, model and data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from kvmix.evaluation.data import load_text, token_ids
from kvmix.evaluation.report import console, print_table, write_results
from kvmix.evaluation.scoring import Scored, score
from kvmix.models.loading import DEFAULT_MODEL, LoadedModel, load_model, model_info
from kvmix.runtime.attention import make_cache
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.kernels import BACKENDS


@dataclass
class JobConfig:
    """What every command takes: the model, the text, precision, device and output folder."""

    model: str = DEFAULT_MODEL
    data: str = "prose"
    dtype: str = "auto"
    device: str = "cpu"
    backend: str = "auto"
    out: str | None = None


def load_inputs(config: Any, n_tokens: int,
                loaded: LoadedModel | None = None) -> tuple[LoadedModel, torch.Tensor]:
    """The model (unless given) and the first ``n_tokens`` tokens of ``config.data``: [1, n].
    A bad backend name fails here, before the model loads."""
    check_backend(config.backend)
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    text = load_text(config.data)
    return loaded, token_ids(loaded.tokenizer, text, n_tokens, f"data={config.data!r}")


def check_inputs(config: Any) -> None:
    """A bad backend name or data source is refused before any model loads."""
    check_backend(config.backend)
    load_text(config.data)


def check_backend(backend: str | list[str]) -> None:
    for name in [backend] if isinstance(backend, str) else backend:
        if name not in BACKENDS:
            raise ValueError(f"backend={name!r} is invalid; valid: {', '.join(BACKENDS)}")


def score_methods(loaded: LoadedModel, ids: torch.Tensor, methods: list[str], context: int,
                  chunk: int, backend: str = "auto") -> dict[str, Scored]:
    """Score each distinct method string once, in order, over the same tokens."""
    for method in dict.fromkeys(methods):  # every method binds to the model before any work
        make_cache(prepare_model(loaded.model, method), method, backend)
    results: dict[str, Scored] = {}
    with Progress(console=console, transient=True) as bar:
        for method in dict.fromkeys(methods):
            task = bar.add_task(method, total=ids.shape[1] - context - 1)
            results[method] = score(loaded.model, ids, method, context, chunk,
                                    progress=lambda n, t=task: bar.advance(t, n),
                                    backend=backend)
    return results


def scored_inputs(worker: Any, config: Any) -> tuple[LoadedModel, torch.Tensor, Scored]:
    """A grid worker's model, the config's ``context + eval_tokens + 1`` tokens [1, n] and the
    ``full`` cache's scores of them (what every method is measured against), made once per
    worker."""
    loaded = worker.loaded
    ids = worker.memo("ids", lambda: load_inputs(
        config, config.context + config.eval_tokens + 1, loaded)[1])
    full = worker.memo("full", lambda: score(loaded.model, ids, "full", config.context,
                                             config.chunk, backend=config.backend))
    return loaded, ids, full


def finish(command: str, config: Any, model: LoadedModel | dict, rows: list[dict], title: str,
           columns: dict[str, str], uses_data: bool = True, **extra: Any) -> Path | None:
    """Print the table; with ``config.out`` write results.json and say where. ``model``: the
    loaded model, or what ``model_info`` said of it (a grid's workers hold it)."""
    info = model if isinstance(model, dict) else model_info(model)
    title = f"kvmix {command} · {info['name']} · {title}"
    print_table(title, rows, columns)
    if not config.out:
        return None
    data = {"data": {"name": config.data}} if uses_data else {}
    path = write_results(config.out, command, config, rows, (title, columns), model=info,
                         **data, **extra)
    console.print(f"wrote {path}")
    return path
