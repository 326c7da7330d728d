"""The settings of kvmix's vLLM plugin (``--additional-config '{"kvmix": ...}'``): their names,
values and the ``METHOD@KEY=VALUE`` grammar of kvmix's rows that start vLLM. Shared by the
plugin (``kvmix.vllm.settings`` resolves them against vLLM's configuration) and by the commands
that start vLLM (``kvmix loadtest``, ``serve``, ``compare --engine vllm``), which never import
the plugin."""

from __future__ import annotations

from typing import Any

import torch

from kvmix.methods import Method

KEY = "kvmix"  # the key of --additional-config
STAGING = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
           "auto": None}  # auto: the model's dtype
KERNELS = ("auto", "cpu", "triton", "torch")  # auto: the CPU op on CPU, Triton on CUDA
# decode: every prompt token attends as a decode at its position would (outputs independent of
# chunking and of the prefix cache); exact: a prompt's first chunk attends to itself in float,
# as a float prefill does (kvmix's own cache, KIVI), later chunks as decodes
PREFILLS = ("decode", "exact")
# group: a group's values are staged as floats with its keys and sealed with them (the method
# as kvmix runs it); token: each token's values go to its page as it arrives, packed per token
# (per-token value methods on the CPU op): half the staging, and a token's own group's values
# are read quantized — a change of what the method computes (measured: docs/benchmarks)
VALUES = ("group", "token")
FIELDS = ("method", "staging", "kernels", "prefill", "values")
AT = "@"  # METHOD@values=token: a method string followed by the plugin's other settings


class Refused(ValueError):
    """A setting kvmix cannot honour inside vLLM, named before the engine starts."""


def checked(raw: dict[str, Any]) -> dict[str, Any]:
    """``raw`` settings, or ``Refused`` naming an unknown one or an invalid value."""
    unknown = sorted(set(raw) - set(FIELDS))
    if unknown:
        raise Refused(f"unknown kvmix setting(s) {unknown}; valid: {', '.join(FIELDS)}")
    for name, valid, default in (("kernels", KERNELS, "auto"), ("prefill", PREFILLS, "decode"),
                                 ("values", VALUES, "group"), ("staging", STAGING, "auto")):
        if raw.get(name, default) not in valid:
            raise Refused(f"{name}={raw[name]!r} is invalid; valid: {', '.join(valid)}")
    return raw


def split(text: str) -> tuple[str, dict[str, str]]:
    """``METHOD@KEY=VALUE,...`` (a row of ``kvmix loadtest`` or ``compare --engine vllm``) ->
    the method string and the plugin's other settings (``Refused`` naming an invalid one)."""
    method, _, rest = text.partition(AT)
    pairs = dict(item.partition("=")[::2] for item in rest.split(",")) if rest else {}
    if "method" in pairs:
        raise Refused(f"{text!r} names its method before {AT!r}, not as a setting after it")
    return method, checked(pairs)


def staging_dtype(name: str | None, method: Method, dtype: torch.dtype) -> torch.dtype:
    """The staging dtype a setting names (checked by ``checked``; ``auto``: the model's
    ``dtype``), by default the one kvmix's own cache keeps its float tail in
    (``Method.slot_dtype``)."""
    return method.slot_dtype(dtype) if name is None else STAGING[name] or dtype
