"""What ``--additional-config '{"kvmix": ...}'`` asks for, checked against vLLM's configuration
before the engine starts: a bound method, the staging dtype and the layout inside vLLM.

Inside vLLM a block is one kvmix group: vLLM fills a block token by token and may hand a full
block to another request through its prefix cache, so a group is sealed into its block the step
it fills, and every sealed block holds codes only. The float tail is the open group of each
running sequence (its "staging"), and there is no float sink: a method runs with ``sink=0`` and
``residual=group`` (what kvmix's own cache calls the layout; a method string that asks for
another sink or residual is refused). Per-sequence choices (PN-Mix's pairs, Kitty's and
ChanMix's channels) are made from the sequence's first group, its first ``group`` tokens, so a
shared prefix's blocks carry the same choice whichever request sealed them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from kvmix.methods import Method, ModelSpec, parse_method
from kvmix.models.loading import config_rope_pairs
from kvmix.runtime.cache import model_spec
from kvmix.runtime.folding import CONFIG_KEY
from kvmix.runtime.plugin_settings import KEY, Refused, checked, staging_dtype
from kvmix.vllm.pages import layout

# Methods whose blocks the plugin serves: a fused decode path in kvmix, or a per-token format.
SERVED = ("full", "kivi", "kxvy", "pnmix", "kitty", "chanmix", "wush", "ggml")


@dataclass(frozen=True, eq=False)
class Settings:
    """A resolved kvmix configuration: the method bound to the model (with the layout above),
    the dtype of the float staging, the method string as given, and the kernels decode rows
    go through (``KERNELS``)."""

    method: Method
    staging: torch.dtype
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
    try:
        parsed = parse_method(text)
    except ImportError as error:  # a backend's library missing from vLLM's environment
        raise Refused(f"kvmix method {text!r}: {error}") from error
    method = laid_out(parsed, text)
    model_config = vllm_config.model_config
    dtype = model_config.dtype
    staging = staging_dtype(raw.get("staging"), method, dtype)
    hf_config = model_config.hf_config
    folded = getattr(hf_config, CONFIG_KEY, None) or {}
    spec = model_spec(hf_config, config_rope_pairs(hf_config), None, folded.get("id"))
    if "model" in folded:  # the name the transforms were calibrated for
        spec = dataclasses.replace(spec, name=folded["model"])
    spec = per_rank(spec, vllm_config, method, text)
    try:
        method.bind(spec)
    except ValueError as error:
        raise Refused(f"kvmix method {text!r} on this model: {error}") from error
    layout(method, spec, 0, dtype)  # Refused where a page cannot be laid out inside vLLM
    values = raw.get("values", "group")
    if values == "token" and not stored_by_token(method, spec):
        raise Refused(f"values='token' cannot be honoured for {text!r}: its values are not "
                      "per-token groups (valid for kivi, kxvy, pnmix, kitty and chanmix)")
    return Settings(method, staging, text, spec, dtype, raw.get("kernels", "auto"),
                    raw.get("prefill", "decode"), values)


def stored_by_token(method: Method, spec: ModelSpec) -> bool:
    """Whether every layer of ``method`` (bound to ``spec``) stores its values token by token
    (``Method.token_values``) as min-max groups, the encoding the CPU op writes them in."""
    return all(q is not None and not q.center and q.minimum is not None
               for q in token_value_probes(method, spec))


def token_value_probes(method: Method, spec: ModelSpec) -> list[Any]:
    """One token's values encoded by each layer's ``Method.token_values`` (None: not per
    token)."""
    probe = torch.zeros(1, spec.n_kv_heads, 1, spec.head_dim)
    return [method.token_values(probe, layer) for layer in range(spec.n_layers)]


def per_rank(spec: ModelSpec, vllm_config: Any, method: Method, text: str) -> ModelSpec:
    """``spec`` with the heads of one tensor-parallel rank, as vLLM's attention layers hold
    them (``get_num_kv_heads``: KV heads split, or replicated one a rank when fewer than the
    ranks); ``Refused`` for the parallelism kvmix does not serve."""
    parallel, model = vllm_config.parallel_config, vllm_config.model_config
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
    heads, kv_heads = (model.get_num_attention_heads(parallel),
                       model.get_num_kv_heads(parallel))
    if parallel.tensor_parallel_size > 1 and method.name == "wush":
        raise Refused(f"kvmix method {text!r} cannot run with --tensor-parallel-size "
                      f"{parallel.tensor_parallel_size}: WUSH's transforms are per KV head of "
                      "the whole model, not sliced per rank")
    return dataclasses.replace(spec, n_heads=heads, n_kv_heads=kv_heads)


def laid_out(method: Method, text: str) -> Method:
    """``method`` with the layout vLLM's blocks allow (no sink, the open group as residual);
    ``Refused`` for a method the plugin does not serve or a layout the string asks for."""
    if method.name not in SERVED:
        raise Refused(f"kvmix method {method.name!r} is not served inside vLLM; served: "
                      f"{', '.join(SERVED)} (and their presets)")
    asked = _overrides(text)
    if asked.get("sink", 0) not in (0, "0"):
        raise Refused(f"sink={asked['sink']} cannot be honoured inside vLLM: a block vLLM's "
                      "prefix cache shares holds codes only, so there is no float sink (sink=0)")
    if "residual" in asked and int(asked["residual"]) != method.group:
        raise Refused(f"residual={asked['residual']} cannot be honoured inside vLLM: the float "
                      f"tail is the open group (residual=group={method.group})")
    return dataclasses.replace(method, sink=0, residual=method.group)


def _overrides(text: str) -> dict[str, str]:
    _, _, rest = text.partition(":")
    pairs = (item.partition("=") for item in rest.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, _, value in pairs}
