"""Evaluation grids on Ray, with a real local Ray (2 CPUs) started once for the module and shut
down after it, every file it wrote removed: a grid on two workers gives the local grid's
results; a grid stopped part-way resumes and computes only its missing cells; a failing cell is
reported and the others kept. A tiny random model saved to a folder stands for the user's."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("ray", reason="the ray extra is not installed")
os.environ["RAY_AUTH_MODE"] = "disabled"

import ray
from conftest import ray_files, saved_model

from kvmix.cli import main
from kvmix.commands.compare import CompareConfig, run_compare
from kvmix.jobs import grid
from kvmix.jobs.grid import Failure, Grid, Worker
from kvmix.models.loading import load_tokenizer

pytestmark = pytest.mark.xdist_group("ray")  # under xdist: one local Ray at a time
LAYOUT = "sink=4,residual=16,group=8"
METHODS = ["full", f"kivi2:{LAYOUT}", f"pnmix1:{LAYOUT}", "kivi2:value_group=64"]  # the last
# cannot bind to head dim 32: it fails in its worker


@pytest.fixture(scope="module")
def model_folder():
    with saved_model(load_tokenizer("smollm2")) as folder:
        yield folder


@pytest.fixture(scope="module")
def local_ray():
    with ray_files():
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
        try:
            yield
        finally:
            ray.shutdown()


@contextlib.contextmanager
def threads(count: int):
    """torch's threads in this process, as a Ray worker of ``count`` CPUs has them (the sums
    of a matmul follow the thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def results(folder) -> dict:
    """results.json's rows by method, timings left out."""
    rows = json.loads((folder / "results.json").read_text())["rows"]
    return {r["method"]: {k: v for k, v in r.items() if k != "seconds"} for r in rows}


def config(model_folder, out, **extra) -> CompareConfig:
    return CompareConfig(model=model_folder, methods=METHODS, context=64, eval_tokens=16,
                         out=str(out), **extra)


@pytest.fixture(scope="module")
def on_ray(local_ray, model_folder, tmp_path_factory):
    """The grid's folder after one run on two Ray workers (the failed cell keeps no rows)."""
    folder = tmp_path_factory.mktemp("ray")
    run_compare(config(model_folder, folder, ray=True, workers=2))
    return folder


@pytest.mark.process
def test_a_grid_on_two_workers_equals_the_local_grid(on_ray, model_folder, tmp_path):
    with threads(1):
        run_compare(config(model_folder, tmp_path / "local"))
    local = results(tmp_path / "local")
    assert results(on_ray) == local and sorted(local) == sorted(METHODS[:3])
    info = json.loads((on_ray / "results.json").read_text())["model"]
    assert info["name"] == model_folder and info["layers"] == 2


@pytest.mark.process
def test_a_grid_stopped_part_way_resumes_only_its_missing_cells(on_ray, model_folder, capsys):
    """One cell's rows removed (the run stopped before it): the rerun keeps the others'
    files as they were and computes that one only (and the failed one again, which fails in
    its worker as before); the results are the same."""
    cells = sorted((on_ray / "cells").glob("*.json"))
    assert len(cells) == 3  # the failed cell keeps no rows
    before = {path: path.stat().st_mtime_ns for path in cells}
    whole = results(on_ray)
    cells[1].unlink()
    capsys.readouterr()
    run_compare(config(model_folder, on_ray, ray=True, workers=2))
    said = " ".join(capsys.readouterr().err.split())  # the console wraps its lines
    assert "2 of 4 cells done before" in said
    assert "kivi2:value_group=64 failed: ValueError: value_group=64" in said
    assert all(path.stat().st_mtime_ns == t for path, t in before.items() if path != cells[1])
    assert cells[1].exists() and results(on_ray) == whole


@pytest.mark.parametrize(("argv", "message"), [
    (["--address", "127.0.0.1:6379"], "address goes with --ray"),
    (["--ray", "--workers", "0"], "workers=0 is invalid"),
    (["--ray", "--address", "127.0.0.1:1"], "no Ray cluster answers there"),
    (["--ray", "--address", "nowhere"], "address='nowhere' is invalid"),
])
def test_bad_ray_settings_fail_before_any_work(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["compare", "--methods", "kivi2", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def dies_on_cue(worker, shared, cell) -> list[dict]:
    """A cell's rows; the cell "die" ends its worker's process (as an out-of-memory kill)."""
    if cell == "die":
        os._exit(1)
    return [{"cell": cell}]


def raises_on_cue(worker, shared, cell) -> list[dict]:
    if cell == "bad":
        raise KeyError("no such key")
    return [{"cell": cell}]


@pytest.mark.process
def test_a_dead_worker_is_replaced_and_the_other_cells_computed(local_ray, model_folder):
    """One worker; the first cell kills its process (again on the restarted actor): that cell
    fails naming the dead actor, a new worker computes the others."""
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # tests/ is no package
    config = SimpleNamespace(model=model_folder, dtype="float32", device="cpu", ray=True,
                             workers=1, out=None, address=None)
    outcomes, _ = Grid("test", config, dies_on_cue).run(["die", "a", "b"])
    assert isinstance(outcomes[0], Failure) and "Actor" in outcomes[0].error
    assert outcomes[1:] == [[{"cell": "a"}], [{"cell": "b"}]]


def test_a_local_cell_that_raises_anything_fails_alone(monkeypatch):
    """A cell computed here that raises what no check foresaw (a KeyError) is reported as
    its failure, as on Ray; the cells after it are computed."""
    monkeypatch.setattr(grid, "model_info", lambda loaded: {"name": "m"})
    config = SimpleNamespace(model="m", dtype="float32", device="cpu", ray=False, out=None)
    worker = Worker("m", "float32", "cpu", {"loaded": None})
    outcomes, _ = Grid("test", config, raises_on_cue).run(["a", "bad", "b"], worker)
    assert outcomes[0] == [{"cell": "a"}] and outcomes[2] == [{"cell": "b"}]
    assert isinstance(outcomes[1], Failure) and "KeyError" in outcomes[1].error


def test_a_cells_key_follows_the_data_files_content_and_kvmixs_code(tmp_path, monkeypatch):
    """The same command on the same path: an edited data file, or other kvmix sources, give
    another key (the cell is computed again); the same content gives the same key."""
    data = tmp_path / "data.txt"
    data.write_text("one text")
    config = SimpleNamespace(model="m", dtype="float32", device="cpu", data=str(data),
                             out=str(tmp_path))
    cells = Grid("test", config, raises_on_cue)
    first = cells.digest("a")
    assert cells.digest("a") == first and cells.digest("b") != first
    data.write_text("another text")
    os.utime(data, ns=(1, 1))  # a new modification time, whatever the clock's resolution
    edited = cells.digest("a")
    assert edited != first
    monkeypatch.setattr(grid, "code_digest", lambda: "other sources")
    assert cells.digest("a") != edited
