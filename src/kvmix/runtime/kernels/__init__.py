"""Attention over one sequence's packed cache: the torch reference (``reference``: decode the
blocks, then SDPA), the fused CPU op (``cpu``) and the Triton kernels (``gpu``), which read
scores and outputs straight from the codes, mirror the reference and are tested against it.
``resolve`` turns a requested backend into the one that runs."""

from __future__ import annotations

import os
import warnings

import torch

from kvmix.runtime.kernels import cpu, gpu

BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve(backend: str, device: torch.device | str) -> str:
    """``auto``: the fused op of the device where it runs (CPU: the built op; CUDA: Triton),
    else the reference with one warning naming the cause; an explicit backend that cannot run
    is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid; valid: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        return _triton(backend, device)
    if device.type != "cpu":
        if backend == "cpu":
            raise ValueError(f"backend='cpu' runs on CPU tensors; the model is on {device} "
                             "(use backend='torch' or 'auto')")
        return "torch"
    ok, cause = cpu.available()
    if ok:
        return "cpu"
    if backend == "cpu":
        raise ValueError(f"backend='cpu' is unavailable: {cause}")
    warnings.warn(f"kvmix's CPU decode op is unavailable, using the reference path: {cause}",
                  stacklevel=3)
    return "torch"


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton(backend: str, device: torch.device) -> str:
    ok, cause = gpu.available()
    if device.type != "cuda" and not interpreting():
        cause = f"Triton runs on CUDA tensors; the model is on {device}"
        ok = False
    if ok:
        return "triton"
    if backend == "triton":
        raise ValueError(f"backend='triton' is unavailable: {cause}")
    warnings.warn(f"kvmix's Triton kernels are unavailable, using the reference path: {cause}",
                  stacklevel=4)
    return "torch"
