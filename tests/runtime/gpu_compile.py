"""Compile every Triton kernel a decode runs for an H200 (sm_90) on a machine without a GPU:
the interpreter runs kernels but never compiles them, so this is where a kernel that only the
compiler refuses shows up. Run as a script (``python tests/runtime/gpu_compile.py``) in a
process without TRITON_INTERPRET: it drives caches of every key layout through a prompt, a few
new queries and decode steps (dense and sliding-window layers, encoders on), with each kernel
launch replaced by a compile of that launch for the target, and prints one line per compiled
specialisation: kernel name, warps, shared memory bytes, cubin bytes."""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels, not interpreted ones
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kvmix.core import fused
from kvmix.runtime.kernels import gpu

TARGET = GPUTarget("cuda", 90, 32)  # H100 / H200
BACKEND = make_backend(TARGET)
SEEN: dict = {}


class Compile:
    """Stands for a kernel: each launch compiles it for TARGET (once per specialisation);
    outputs are left as allocated (only the launches' arguments matter here)."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kernel = self.kernel
            binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
            bound, specialization, options = binder(*args, **kwargs)
            options, signature, constexprs, attrs = kernel._pack_args(
                BACKEND, kwargs, bound, specialization, options)
            key = (self.name, str(signature), str(constexprs), str(attrs))
            if key not in SEEN:
                compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                          target=TARGET, options=options.__dict__)
                SEEN[key] = (self.name, compiled.metadata.num_warps, compiled.metadata.shared,
                             len(compiled.asm["cubin"]))
        return launch


def main() -> None:
    for module, name in ((gpu, "_pages"), (gpu, "_merge"), (fused, "_quantize")):
        setattr(module, name, Compile(name, getattr(module, name)))
    os.environ["TRITON_INTERPRET"] = "1"  # kvmix's checks: Triton kernels on CPU tensors
    from helpers import make, prefill, step, tokens

    from kvmix.runtime.layer import take_pending

    for name, window in [("kivi2", None), ("pnmix1", None), ("chanmix", None), ("wush", None),
                         ("full", None), ("kxvy:key_bits=3,value_bits=3", None),
                         ("pnmix1", 20), ("wush", 20)]:
        cache = make(name, backend="triton", window=window)
        prefill(cache, [45, 9, 30])
        for i in range(2):
            step(cache, 3, seed=i)
        keys, values, queries = tokens(3, 4, seed=9, dtype=torch.float16)  # a chunk of 4
        if window is None:
            cache.update(keys, values, 0)
            take_pending().attend(cache.method.transform_queries(queries, 0), None, 0.2)
    for kernel, warps, shared, cubin in SEEN.values():
        print(kernel, warps, shared, cubin)


if __name__ == "__main__":
    main()
