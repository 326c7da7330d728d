"""What ``--additional-config '{"kvmix": ...}'`` asks for, checked against vLLM's configuration
before the engine starts: a bound method, the staging dtype and the layout inside vLLM.

Inside vLLM a block is one kvmix group: vLLM fills a block token by token and may hand a full
block to another request through its prefix cache, so a group is sealed into its block the step
it fills, and every sealed block holds codes only. The float tail is the open group of each
running sequence (its "staging"), and there is no float sink: a method runs with ``sink=0`` and
``residual=group`` (the layout, one rule with the commands that start vLLM:
``kvmix.runtime.inside_vllm``; a method string that asks for another sink or residual is
refused). Per-sequence choices (PN-Mix's pairs, Kitty's and
ChanMix's channels) are made from the sequence's first group, its first ``group`` tokens, so a
shared prefix's blocks carry the same choice whichever request sealed them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmix.methods import Method, ModelSpec
from kvmix.runtime.inside_vllm import bound
from kvmix.runtime.plugin_settings import KEY, Refused, checked
from kvmix.vllm.pages import page_layout


@dataclass(frozen=True, eq=False)
class Settings:
    """A resolved kvmix configuration: the method bound to the model (with the layout above),
    the dtype of the float staging (the ``staging`` setting), the method string as given, and
    the kernels decode rows go through (``KERNELS``)."""

    method: Method
    staging_dtype: torch.dtype
    text: str
    spec: ModelSpec
    dtype: torch.dtype  # the model's
    kernels: str = "auto"
    prefill: str = "decode"  # PREFILLS
    values: str = "group"  # VALUES

    @property
    def staged_values(self) -> bool:
        """Whether the staging holds the open group's values (else its keys only)."""
        return self.values == "group"

    @property
    def group(self) -> int:
        return self.method.group


def requested(vllm_config: Any) -> dict[str, Any] | None:
    """The kvmix entry of vLLM's additional config ({"method": ..., "staging": ...,
    "kernels": ..., "prefill": ..., "values": ...}), or None."""
    extra = getattr(vllm_config, "additional_config", None) or {}
    raw = extra.get(KEY) if isinstance(extra, dict) else None
    if raw is None:
        return None
    if isinstance(raw, str):
        raw = {"method": raw}
    if not isinstance(raw, dict) or "method" not in raw:
        raise Refused(f'--additional-config {{"{KEY}": ...}} must be a method string or '
                      f'{{"method": "...", "staging": "float16", "kernels": "auto"}}; '
                      f'got {raw!r}')
    return checked(raw)


_RESOLVED: dict[tuple, Settings] = {}


def resolve(vllm_config: Any) -> Settings | None:
    """The kvmix settings of a vLLM configuration, or None where kvmix is not asked for;
    ``Refused`` naming what cannot be honoured. Resolved once per engine configuration: the
    backend class, its builder and every layer get the same ``Settings``."""
    raw = requested(vllm_config)
    if raw is None:
        return None
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    sizes = tuple(getattr(parallel, name, 1) for name in (
        "tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size",
        "decode_context_parallel_size"))
    key = (repr(sorted(raw.items())), id(model), id(model.hf_config), model.model,
           str(model.dtype), sizes, str(vllm_config.device_config.device))
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolved(raw, vllm_config)
    return _RESOLVED[key]


def _resolved(raw: dict[str, Any], vllm_config: Any) -> Settings:
    text = str(raw["method"])
    model, parallel = vllm_config.model_config, vllm_config.parallel_config
    refuse_parallelism(vllm_config, text)
    heads = (model.get_num_attention_heads(parallel), model.get_num_kv_heads(parallel))
    resolved = bound(text, raw, model.hf_config, model.dtype, heads,
                     parallel.tensor_parallel_size)
    method, spec = resolved.method, resolved.spec
    page_layout(method, spec, 0, model.dtype)  # Refused where a page cannot be laid out inside vLLM
    return Settings(method, resolved.staging_dtype, text, spec, model.dtype,
                    raw.get("kernels", "auto"), raw.get("prefill", "decode"),
                    raw.get("values", "group"))


def refuse_parallelism(vllm_config: Any, text: str) -> None:
    """``Refused`` for the parallelism kvmix does not serve (tensor parallelism is served:
    each rank holds vLLM's share of the heads, ``get_num_kv_heads``)."""
    parallel = vllm_config.parallel_config
    for flag, size, why in (
            ("--pipeline-parallel-size", parallel.pipeline_parallel_size,
             "untested: each stage would hold its own staging"),
            ("--prefill-context-parallel-size",
             getattr(parallel, "prefill_context_parallel_size", 1),
             "a rank would hold part of each group"),
            ("--decode-context-parallel-size",
             getattr(parallel, "decode_context_parallel_size", 1),
             "a rank would hold part of each group")):
        if size > 1:
            raise Refused(f"kvmix method {text!r} cannot run with {flag} {size} ({why}); "
                          "tensor parallelism is served")
