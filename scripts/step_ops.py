"""What one layer's decode step dispatches, counted on any machine: the torch ops outside the
kernels (views aside; on a GPU each is a launch) and the Triton launches, for the Triton backend
(in the interpreter without a GPU) and the CPU op, on the tests' small shapes (a ragged batch of
3 with sealed pages, float32). Usage: python scripts/step_ops.py [METHOD ...]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch
from helpers import make, prefill, tokens
from torch.utils._python_dispatch import TorchDispatchMode

from kvmix.runtime.kernels import gpu
from kvmix.runtime.layer import take_pending

VIEWS = {"view", "_unsafe_view", "expand", "slice", "select", "unsqueeze", "squeeze",
         "transpose", "t", "alias", "as_strided", "detach", "permute", "reshape", "lift_fresh",
         "unbind"}


class Ops(TorchDispatchMode):
    """The torch ops dispatched while active, but inside a kernel launch (the interpreter's)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []
        self.launching = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS and not self.launching:
            self.names.append(name)
        return func(*args, **(kwargs or {}))


class Launches:
    """Stands for a Triton kernel: counts its launches, which run with op counting paused."""

    def __init__(self, kernel, ops: list[Ops]):
        self.kernel, self.ops, self.count = kernel, ops, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.count += 1
            for mode in self.ops:
                mode.launching = True
            try:
                return self.kernel[grid](*args, **kwargs)
            finally:
                for mode in self.ops:
                    mode.launching = False
        return launch


def main() -> None:
    active: list[Ops] = []
    kernels = [Launches(gpu._pages, active), Launches(gpu._merge, active)]
    gpu._pages, gpu._merge = kernels
    backends = ["cpu"] + (["triton"] if gpu.available()[0] else [])
    for backend in backends:
        for method in sys.argv[1:] or ["kivi2", "pnmix1", "wush"]:
            cache = make(method, backend=backend)
            prefill(cache, [45, 9, 30])
            for i in range(3):  # views and tables built, as in a running decode
                keys, values, queries = tokens(3, 1, seed=i, dtype=torch.float32)
                cache.update(keys, values, 0)
                take_pending().attend(cache.method.transform_queries(queries, 0), None, 0.2)
            keys, values, queries = tokens(3, 1, seed=50, dtype=torch.float32)
            queries = cache.method.transform_queries(queries, 0)
            before = sum(k.count for k in kernels)
            mode = Ops()
            active[:] = [mode]
            with mode:
                cache.update(keys, values, 0)
                layer = take_pending()
                layer._write_and_attend(queries, *layer.pending, 0.2)
            launched = sum(k.count for k in kernels) - before
            print(f"{backend:6} {method:8} torch ops {len(mode.names):3}  Triton launches "
                  f"{launched}  ({', '.join(sorted(set(mode.names)))})")


if __name__ == "__main__":
    main()
