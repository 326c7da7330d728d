"""Evaluation grids as cells (docs/guide/ray.md). A command's grid is a list of cells — a method of
a compare, a point of a sweep, a batch of prompts of a longgen, a method of an eval — each computed
by a worker that holds the model: one in this process, or, with ``ray``, Ray actors (``workers`` of
them, each loading the model once, ``num_gpus=1`` each on CUDA) taking cells as they free up.

With an output folder, each cell's rows are written to ``cells/<hash>.json``, the hash of the
cell's resolved configuration (the command's settings, the cell, the model, the data file's
content and a hash of kvmix's own sources, so an edited checkout or a changed file computes
again): a rerun of the same command skips the cells whose rows exist and computes only the
missing ones. A cell that fails — whatever it raises, here or on Ray — is reported with its
error and the others kept; a Ray worker that died is replaced. The merged rows are the local
run's, whoever computed them."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rich.progress import Progress

from kvmix.jobs.ray import reachable, require_ray
from kvmix.jobs.report import console, version
from kvmix.models.loading import LoadedModel, load_model, model_info

RETRIES = 1  # a cell whose worker died is tried once more (on the restarted worker)


@dataclass
class Failure:
    """A cell that raised: what, where."""

    cell: Any
    error: str


@dataclass
class Worker:
    """What computes cells: the model, loaded once, and what its cells share (``memo``)."""

    model: str
    dtype: str
    device: str
    memos: dict = field(default_factory=dict, repr=False)

    @property
    def loaded(self) -> LoadedModel:
        if "loaded" not in self.memos:
            self.memos["loaded"] = load_model(self.model, self.dtype, self.device)
        return self.memos["loaded"]

    @classmethod
    def holding(cls, loaded: LoadedModel | None, config: Any) -> Worker | None:
        """A worker in this process with an already loaded model (None: load when needed)."""
        if loaded is None:
            return None
        return cls(config.model, config.dtype, config.device, {"loaded": loaded})

    def memo(self, key: Any, make: Callable[[], Any]) -> Any:
        """``make()`` once per worker for ``key`` (a reference score its cells share, ...)."""
        if key not in self.memos:
            self.memos[key] = make()
        return self.memos[key]

    def compute(self, compute: Callable, shared: Any, cell: Any) -> dict[str, Any]:
        """A cell's rows and what results.json says of the model that made them."""
        rows = compute(self, shared, cell)
        return {"rows": rows, "model": model_info(self.loaded)}


@dataclass
class GridConfig:
    """What a command that runs a grid takes besides its own settings."""

    ray: bool = False  # cells as Ray tasks
    address: str | None = None  # the Ray cluster (None: a local Ray; 'auto': `ray start`'s)
    workers: int = 2  # Ray actors, each holding the model once


@dataclass
class Grid:
    """A command's cells, where they run and where their rows are kept."""

    command: str
    config: Any  # the command's configuration: model, dtype, device, out, ray, ...
    compute: Callable[[Worker, Any, Any], list[dict]]  # module-level: Ray imports it by name
    shared: Any = None  # what every cell takes (the command's settings)

    def run(self, cells: list[Any], worker: Worker | None = None
            ) -> tuple[list[list[dict] | Failure], dict[str, Any]]:
        """(every cell's rows, or its ``Failure``, in the order of ``cells``; what results.json
        says of the model)."""
        kept = {i: got for i, cell in enumerate(cells) if (got := self._read(cell)) is not None}
        done: dict[int, Any] = dict(kept)
        todo = [i for i in range(len(cells)) if i not in done]
        if done:
            console.print(f"{self.command}: {len(done)} of {len(cells)} cells done before "
                          f"(under {self._folder()}); computing {len(todo)}")
        runner = self._on_ray if getattr(self.config, "ray", False) else self._here
        with Progress(console=console, transient=True) as bar:
            task = bar.add_task(f"{self.command} cells", total=len(todo))
            for i, outcome in runner([cells[i] for i in todo], todo, worker):
                done[i] = outcome
                if not isinstance(outcome, Failure):
                    self._write(cells[i], outcome)
                bar.advance(task)
        for outcome in done.values():
            if isinstance(outcome, Failure):
                console.print(f"[red]{self.command}: cell {outcome.cell} failed: "
                              f"{outcome.error}[/]")
        made = [o for o in done.values() if not isinstance(o, Failure)]
        model = made[0]["model"] if made else {"name": self.config.model}
        return [o if isinstance(o, Failure) else o["rows"] for o in
                (done[i] for i in range(len(cells)))], model

    # -- where cells run -----------------------------------------------------------------------

    def _here(self, cells: list, indices: list[int], worker: Worker | None):
        worker = worker or self._worker()
        for index, cell in zip(indices, cells, strict=True):
            try:
                yield index, worker.compute(self.compute, self.shared, cell)
            except Exception as error:  # any cell's fault is its own, as on Ray
                yield index, Failure(cell, _cause(error))

    def _on_ray(self, cells: list, indices: list[int], worker: Worker | None):
        ray = require_ray()
        address = getattr(self.config, "address", None)
        started = not ray.is_initialized()
        if started:
            reachable(address)
            ray.init(address=address, include_dashboard=False, log_to_driver=False)
        try:
            yield from _spread(ray, self, cells, indices)
        finally:
            if started:
                ray.shutdown()

    def _worker(self) -> Worker:
        c = self.config
        return Worker(c.model, c.dtype, c.device)

    # -- cells kept under --out ------------------------------------------------------------------

    def _folder(self) -> Path | None:
        out = getattr(self.config, "out", None)
        return None if out is None else Path(out) / "cells"

    def digest(self, cell: Any) -> str:
        """The hash of a cell's resolved configuration."""
        c = self.config
        key = {"command": self.command, "cell": _plain(cell), "shared": _plain(self.shared),
               "model": c.model, "dtype": c.dtype, "device": c.device,
               "data": content_digest(getattr(c, "data", None)), "kvmix": version("kvmix"),
               "code": code_digest()}
        return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()) \
            .hexdigest()[:24]

    def _read(self, cell: Any) -> dict[str, Any] | None:
        folder = self._folder()
        path = None if folder is None else folder / f"{self.digest(cell)}.json"
        if path is None or not path.exists():
            return None
        return json.loads(path.read_text())

    def _write(self, cell: Any, made: dict[str, Any]) -> None:
        folder = self._folder()
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.digest(cell)}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps({"cell": _plain(cell), **made}, default=str))
        os.replace(partial, path)  # a killed run never leaves half a cell


def _spread(ray: Any, grid: Grid, cells: list, indices: list[int]):
    """Cells over ``grid.config.workers`` Ray actors, each taking the next cell when it is
    free -> (index, rows or Failure) as they finish."""
    c = grid.config
    gpus = 1 if c.device.startswith("cuda") else 0
    remote = ray.remote(num_cpus=getattr(c, "worker_cpus", 1), num_gpus=gpus,
                        max_restarts=RETRIES, max_task_retries=RETRIES)(Worker)
    workers = [remote.remote(c.model, c.dtype, c.device)
               for _ in range(min(getattr(c, "workers", 2), len(cells)) or 1)]
    queue = list(zip(indices, cells, strict=True))
    running: dict[Any, tuple[Any, int, Any]] = {}

    def give(worker: Any) -> None:
        if queue:
            index, cell = queue.pop(0)
            running[worker.compute.remote(grid.compute, grid.shared, cell)] = (worker, index,
                                                                                cell)

    for worker in workers:
        give(worker)
    while running:
        ready, _ = ray.wait(list(running), num_returns=1)
        worker, index, cell = running.pop(ready[0])
        try:
            yield index, ray.get(ready[0])
        except ray.exceptions.RayActorError as error:  # its worker died past its retries
            yield index, Failure(cell, _cause(error))
            worker = remote.remote(c.model, c.dtype, c.device)  # a new one takes its place
        except Exception as error:  # the cell raised
            yield index, Failure(cell, _cause(error))
        give(worker)


@functools.cache
def code_digest() -> str:
    """A hash of kvmix's own sources (every file of the package but compiled ones): a cell
    computed by other code is computed again."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in {".py", ".cpp", ".h", ".cu", ".json", ".toml"}:
            digest.update(str(path.relative_to(root)).encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()[:24]


def content_digest(data: Any) -> Any:
    """A data setting as a cell's key: a file by its content (a changed file is new data),
    anything else as it is."""
    if not isinstance(data, (str, os.PathLike)) or not Path(data).is_file():
        return data
    path = Path(data).resolve()
    stat = path.stat()
    return _file_digest(str(path), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _file_digest(path: str, size: int, mtime: int) -> str:
    """A file's content hash, read once per (path, size, modification time)."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()[:24]


def check_grid(config: Any) -> None:
    """A grid's Ray settings, refused before any work."""
    workers = getattr(config, "workers", 1)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers={workers!r} is invalid; expected an integer >= 1")
    if getattr(config, "address", None) is not None and not getattr(config, "ray", False):
        raise ValueError("address goes with --ray")
    if getattr(config, "ray", False):
        require_ray()
        reachable(config.address)


def merged(outcomes: list[list[dict] | Failure]) -> list[dict]:
    """The rows of the cells that went through, in order (``Grid.run`` reports failures)."""
    return [row for o in outcomes if not isinstance(o, Failure) for row in o]


def _plain(value: Any) -> Any:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    return value


def _cause(error: Exception) -> str:
    cause = getattr(error, "cause", None) or error
    return f"{type(cause).__name__}: {cause}".splitlines()[0][:500]
