"""Every Triton kernel of a decode compiles for the H200 (sm_90, Triton's own ptxas) on this
CPU machine: the interpreter runs kernels but never compiles them (``gpu_compile.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvmix.runtime.kernels import gpu

SCRIPT = Path(__file__).with_name("gpu_compile.py")


def nvidia_backend() -> bool:
    if not gpu.available()[0]:
        return False
    from triton.backends import backends

    return "nvidia" in backends


@pytest.mark.skipif(not nvidia_backend(), reason="Triton or its NVIDIA backend is not installed")
@pytest.mark.process
def test_every_kernel_compiles_for_sm90():
    """Per-channel keys of 1, 2 and 4 planes, 3-bit keys, per-token keys, float pages, sliding
    windows, the per-sequence path (a chunk of new queries) and the encoders: each launch's
    specialisation compiles to a cubin."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [line.split() for line in done.stdout.splitlines()]
    kinds = Counter(kernel for kernel, *_ in compiled)
    assert kinds["_pages"] >= 12 and kinds["_merge"] >= 2 and kinds["_quantize"] >= 4, kinds
    assert all(int(cubin) > 0 for *_, cubin in compiled)
