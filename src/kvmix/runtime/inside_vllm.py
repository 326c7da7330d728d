"""A method's layout inside vLLM: one rule for kvmix's plugin (``kvmix.vllm.settings``) and for
the commands that start vLLM (``loadtest``, ``serve --engine vllm``, ``compare --engine
vllm``), which size its staging and score its layout without importing the plugin.

Inside vLLM a block is one kvmix group, sealed the step it fills and shared through vLLM's
prefix cache as codes only: a method runs with no float sink (``sink=0``) and its open group as
the float tail (``residual=group``); the model is one tensor-parallel rank's share of heads,
with the transforms folded into its weights (``kvmix export --fold``) named in its config."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvmix.methods import Method, ModelSpec, parse_method
from kvmix.models.loading import config_rope_pairs
from kvmix.runtime.accounting import open_groups_bytes
from kvmix.runtime.cache import model_spec
from kvmix.runtime.folding import CONFIG_KEY
from kvmix.runtime.plugin_settings import Refused, staging_dtype

# Methods whose blocks the plugin serves: a fused decode path in kvmix, or a per-token format.
SERVED = ("full", "kivi", "kxvy", "pnmix", "kitty", "chanmix", "wush", "ggml")
PLUGIN = "inside vLLM, kvmix"  # who sets the layout, as a refusal names it


@dataclasses.dataclass(frozen=True)
class Bound:
    """A method string resolved for vLLM: the method laid out and bound to one rank's model,
    and the dtype of its float staging."""

    method: Method
    spec: ModelSpec
    staging_dtype: torch.dtype


def bound(text: str, raw: dict[str, Any], hf_config: Any, dtype: torch.dtype,
          heads: tuple[int, int] | None = None, ranks: int = 1) -> Bound:
    """``text`` (a method string) with the plugin's settings ``raw`` on a model of
    ``hf_config`` in ``dtype``, laid out and bound to the rank holding ``heads`` (attention,
    KV; None: all of them) of ``ranks`` tensor-parallel ranks; ``Refused`` naming what cannot
    be honoured (values by token included)."""
    try:
        parsed = parse_method(text)
    except ImportError as error:  # a backend's library missing from vLLM's environment
        raise Refused(f"kvmix method {text!r}: {error}") from error
    method = laid_out(parsed, text)
    if ranks > 1 and method.name == "wush":
        raise Refused(f"kvmix method {text!r} cannot run with --tensor-parallel-size {ranks}: "
                      "WUSH's transforms are per KV head of the whole model, not sliced per "
                      "rank")
    spec = rank_spec(hf_config, heads)
    try:
        method.bind(spec)
    except ValueError as error:
        raise Refused(f"kvmix method {text!r} on this model: {error}") from error
    if raw.get("values") == "token" and not stored_by_token(method, spec):
        raise Refused(f"values='token' cannot be honoured for {text!r}: its values are not "
                      "per-token groups (valid for kivi, kxvy, pnmix, kitty and chanmix)")
    return Bound(method, spec, staging_dtype(raw.get("staging"), method, dtype))


def rank_spec(hf_config: Any, heads: tuple[int, int] | None = None) -> ModelSpec:
    """The model as one rank of vLLM holds it: its attention layout with the folded
    transforms' id (and the model they were calibrated for), and the rank's ``heads``
    (attention, KV; None: the whole model's)."""
    folded = getattr(hf_config, CONFIG_KEY, None) or {}
    spec = model_spec(hf_config, config_rope_pairs(hf_config), None, folded.get("id"))
    if "model" in folded:
        spec = dataclasses.replace(spec, name=folded["model"])
    if heads is not None:
        spec = dataclasses.replace(spec, n_heads=heads[0], n_kv_heads=heads[1])
    return spec


def staging_bytes(resolved: Bound, raw: dict[str, Any], sequences: int) -> int:
    """What the plugin stages beside vLLM's pages for ``sequences`` running at most: the open
    group of every sequence in every layer (keys only with ``values=token``)."""
    return open_groups_bytes(resolved.method, resolved.spec, resolved.staging_dtype, sequences,
                             raw.get("values", "group") == "group")


def laid_out(method: Method, text: str, where: str = PLUGIN) -> Method:
    """``method`` with the layout vLLM's blocks allow (no sink, the open group as residual);
    ``Refused`` for a method the plugin does not serve or a layout ``text`` asks for
    (``where``: who sets it, as the refusal says)."""
    if method.name not in SERVED:
        raise Refused(f"kvmix method {method.name!r} is not served inside vLLM; served: "
                      f"{', '.join(SERVED)} (and their presets)")
    asked = _overrides(text)
    if asked.get("sink", "0") != "0":
        raise Refused(f"{where} sets sink itself (sink=0: a block vLLM's prefix cache shares "
                      f"holds codes only, so there is no float sink): remove sink={asked['sink']}"
                      f" from {text!r}")
    if "residual" in asked and int(asked["residual"]) != method.group:
        raise Refused(f"{where} sets residual itself (residual=group={method.group}: the float "
                      f"tail is the open group): remove residual={asked['residual']} from "
                      f"{text!r}")
    return dataclasses.replace(method, sink=0, residual=method.group)


def _overrides(text: str) -> dict[str, str]:
    _, _, rest = text.partition(":")
    pairs = (item.partition("=") for item in rest.split(",") if "=" in item)
    return {key.strip(): value.strip() for key, _, value in pairs}


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
