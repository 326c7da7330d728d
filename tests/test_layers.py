"""The package's folders are its layers: a module imports only from its own layer or below, and
only the model-loading, runtime and serving modules (transformers' cache, attention registry,
continuous batching and serving app) import transformers."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "kvmix"
LAYERS = ("core", "methods", "models", "runtime", "capacity", "vllm", "jobs", "engines",
          "evaluation", "bench", "serving", "commands", "cli")
PLUGIN = "vllm"  # vLLM's entry point loads it; no kvmix module imports it
TRANSFORMERS_ALLOWED = ("models/loading.py", "runtime/", "serving/")
VLLM_ALLOWED = ("vllm/",)
MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


def layer_of(relative: str) -> str:
    return relative.split("/")[0].removesuffix(".py")


def imported(path: Path) -> list[str]:
    """Every absolute module name ``path`` imports, at any depth (lazy imports included)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: use absolute imports"
            names.append(node.module)
    return names


def test_every_module_belongs_to_a_layer():
    strays = [str(p.relative_to(PACKAGE)) for p in MODULES
              if layer_of(str(p.relative_to(PACKAGE))) not in LAYERS]
    assert not strays


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path):
    relative = str(path.relative_to(PACKAGE))
    own = LAYERS.index(layer_of(relative))
    for name in imported(path):
        if name == "kvmix":
            pytest.fail(f"{relative} imports the top-level package (which imports every layer)")
        if name.startswith("kvmix."):
            target = name.split(".")[1]
            assert LAYERS.index(target) <= own, f"{relative} ({LAYERS[own]}) imports {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_loading_and_runtime_import_transformers(path):
    relative = str(path.relative_to(PACKAGE))
    uses = any(n.split(".")[0] == "transformers" for n in imported(path))
    assert not uses or relative.startswith(TRANSFORMERS_ALLOWED), relative


def test_the_checker_sees_a_violation(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from kvmix.commands.compare import run_compare\n")
    assert "kvmix.commands.compare" in imported(bad)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_the_plugin_imports_vllm_and_nothing_imports_the_plugin(path):
    relative = str(path.relative_to(PACKAGE))
    names = imported(path)
    if not relative.startswith(VLLM_ALLOWED):
        assert not any(n.split(".")[0] == "vllm" for n in names), relative
        assert not any(n.startswith(f"kvmix.{PLUGIN}") for n in names), relative


def module_graph() -> dict[str, set[str]]:
    """Every kvmix module and the kvmix modules it imports (lazy imports included; a name
    imported from a package counts as its submodule where one has that name). A module's own
    packages are left out: Python imports them before it."""
    names = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(
        ".__init__"): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in names.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in names
                            else node.module for a in node.names}
        graph[name] = {t for t in targets if t in names and not name.startswith(f"{t}.")
                       and t != name}
    return graph


def test_no_two_modules_import_each_other_through_any_path():
    graph, seen, path = module_graph(), set(), []

    def visit(name):
        if name in path:
            pytest.fail("import circle: " + " -> ".join([*path[path.index(name):], name]))
        if name in seen:
            return
        path.append(name)
        for target in sorted(graph[name]):
            visit(target)
        path.pop()
        seen.add(name)

    for name in sorted(graph):
        visit(name)
    assert "kvmix.runtime.inside_vllm" in graph["kvmix.engines.vllm.server"]  # lazy, seen


def test_no_function_runs_over_60_lines():
    long = [f"{p.relative_to(PACKAGE)}:{node.lineno} {node.name}" for p in MODULES
            for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno >= 60]
    assert not long
