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
    return _usable(backend, "cpu", *cpu.available(), "CPU decode op")


def unserved(backend: str, method, head_dim: int) -> str:
    """Why ``backend``'s kernels cannot read ``method``'s blocks at ``head_dim`` ("" when they
    can, or when the method reads through the reference path anyway)."""
    kernels = {"cpu": cpu, "triton": gpu}.get(backend)
    if kernels is None or method.unfused():
        return ""
    return kernels.unserved(method, head_dim)


class Unserved(ValueError):
    """Kernels asked for by name cannot decode a cache."""


def choose(asked: str, method, head_dim: int, dtype: torch.dtype, device: torch.device
           ) -> tuple[str, str]:
    """The kernels a paged cache of ``method`` (pages in the model's ``dtype`` on ``device``)
    decodes through — kvmix's fused CPU op (``cpu``), its Triton kernels (``triton``) or the
    reference path (``torch``) — and why not the fused ones ("" when they run). ``auto``: the
    CPU op on CPU, Triton elsewhere, else the reference path; kernels asked for by name that
    cannot read this cache are ``Unserved``. Decided per method instance: settings that turn a
    method's fused path off (``kxvy:backend=quanto``) are seen."""
    choice = asked if asked != "auto" else "cpu" if device.type == "cpu" else "triton"
    reason = "" if choice == "torch" else _fused_unserved(choice, method, head_dim, dtype,
                                                          device)
    if reason and asked != "auto":
        raise Unserved(f"kernels={asked!r} cannot be honoured: {reason}")
    return ("torch" if reason else choice), reason


def _fused_unserved(choice: str, method, head_dim: int, dtype: torch.dtype,
                    device: torch.device) -> str:
    """Why ``choice``'s kernels cannot decode this cache ("" when they can)."""
    if method.unfused():
        return method.unfused()
    if choice == "triton":
        return triton_unusable(device) or unserved(choice, method, head_dim)
    if device.type != "cpu":
        return f"the cache is on {device.type} (the CPU op reads the CPU's memory)"
    reason = cpu.available()[1] or unserved(choice, method, head_dim)
    if not reason and not method.quantizes and dtype != torch.float32:
        reason = f"float pages of {dtype} (the op reads float32)"
    return reason


def interpreting() -> bool:
    """Triton's CPU interpreter (TRITON_INTERPRET=1) runs the kernels on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unusable(device: torch.device) -> str:
    """Why the Triton kernels cannot run on ``device``'s tensors ("" when they can)."""
    ok, cause = gpu.available()
    if ok and device.type != "cuda" and not interpreting():
        return f"Triton runs on CUDA tensors; the model is on {device}"
    return cause


def _triton(backend: str, device: torch.device) -> str:
    cause = triton_unusable(device)
    return _usable(backend, "triton", not cause, cause, "Triton kernels")


def _usable(backend: str, name: str, ok: bool, cause: str, what: str) -> str:
    """``name`` when it runs; else an error if it was asked for by name, or the reference path
    with one warning naming the cause (``auto``)."""
    if ok:
        return name
    if backend == name:
        raise ValueError(f"backend={name!r} is unavailable: {cause}")
    warnings.warn(f"kvmix's {what}: unavailable, using the reference path: {cause}",
                  stacklevel=4)
    return "torch"
