"""Attention over one sequence's packed cache: the torch reference (``reference``: decode the
blocks, then SDPA) and the fused CPU op (``cpu``: scores and outputs straight from the codes),
which mirrors it and is tested against it. ``resolve`` turns a requested backend into the one
that runs."""

from __future__ import annotations

import warnings

import torch

from kvmix.runtime.kernels import cpu

BACKENDS = ("auto", "torch", "cpu")


def resolve(backend: str, device: torch.device | str) -> str:
    """``auto``: the fused op where it runs (CPU, built), else the reference with one warning
    naming the cause; an explicit backend that cannot run is an error."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is invalid; valid: {', '.join(BACKENDS)}")
    device = torch.device(device)
    if backend == "torch":
        return "torch"
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
