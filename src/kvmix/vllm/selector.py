"""The class vLLM resolves for an attention backend: kvmix's backend when vLLM's configuration
names a kvmix method and vLLM picked the backend kvmix stands in for, else the class the member
resolved to before kvmix registered (``FALLBACK``), unchanged.

vLLM loads plugins before it has a configuration, and on CPU it picks ``CPU_ATTN`` whatever
``--attention-backend`` says; on CUDA kvmix runs as ``--attention-backend CUSTOM``. So the
plugin points every member at this module (``register``) and the choice is made here, when vLLM
resolves the class while it builds the model. vLLM's CUDA platform then imports the class again
from ``full_cls_name()``, which names this module too (``KvmixBackend.full_cls_name``).

Other KV-cache plugins register the same members; vLLM runs plugins in the order it finds
them. One found before kvmix is what a member resolves to without kvmix (``FALLBACK``, read at
``register``); one found after would replace the selector in vLLM's registry and run under a
kvmix configuration, so the registry holds the selector's members (``Held``) and the later
class becomes the fallback too.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

STANDS_IN = ("CPU_ATTN", "CUSTOM")  # the members kvmix's backend is resolved for
FALLBACK: dict[str, str | None] = {}  # per member: its path without kvmix
logger = logging.getLogger("vllm.kvmix")  # under vLLM's logger: in `vllm serve`'s log


class Held(dict):
    """vLLM's registry of backend overrides, with every member kvmix's selector answers for
    held by it: a later registration (another plugin found after kvmix) becomes the member's
    class without kvmix (``FALLBACK``), logged with the plugin's name; with kvmix configured,
    the selector still answers (kvmix's backend, or the refusal naming ``CUSTOM``)."""

    def __setitem__(self, member: Any, path: str) -> None:
        held = self.get(member, "")
        if held.startswith(f"{__name__}.") and path != held:
            FALLBACK[member.name] = path
            logger.warning("kvmix: %s registers the %s attention backend (%s) after kvmix; it "
                           "runs unless --additional-config names a kvmix method", owner(path),
                           member.name, path)
            return
        super().__setitem__(member, path)


def hold(registry: Any) -> None:
    """Hold the members kvmix stands in for in vLLM's ``registry`` module (``Held``)."""
    if not isinstance(registry._ATTN_OVERRIDES, Held):
        registry._ATTN_OVERRIDES = Held(registry._ATTN_OVERRIDES)


def owner(path: str) -> str:
    """The installed distribution a class path comes from (its top package where none)."""
    from importlib.metadata import packages_distributions

    top = path.split(".")[0]
    return ", ".join(packages_distributions().get(top, [top]))


def __getattr__(name: str) -> Any:
    from vllm.config import get_current_vllm_config_or_none
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvmix.vllm.settings import requested

    if name not in AttentionBackendEnum.__members__:
        raise AttributeError(name)
    config = get_current_vllm_config_or_none()  # None: vLLM resolves some classes with none
    configured = config is not None and requested(config) is not None
    if configured and name in STANDS_IN:
        from kvmix.vllm.backend import backend_for

        return backend_for(config)
    path = FALLBACK.get(name, AttentionBackendEnum[name].value)
    if not path:
        raise ValueError(f"--attention-backend {name} is kvmix's backend: name a kvmix method "
                         """in --additional-config '{"kvmix": {"method": "kivi2"}}'""")
    found = resolve_obj_by_qualname(path)
    return _refusing(name, found) if configured else found


@functools.cache
def _refusing(name: str, backend: type) -> type:
    """``backend``, whose ``validate_configuration`` (what vLLM's CUDA platform asks of every
    backend it considers for a decoder's attention, named or not) stops vLLM with kvmix's
    message: with kvmix configured, vLLM would run that backend's float cache and ignore kvmix.
    Other uses of the class (a vision encoder's attention) are unchanged."""

    def validate_configuration(cls, *args: Any, **kwargs: Any) -> list[str]:
        from kvmix.vllm.settings import Refused

        raise Refused(f"kvmix is configured (--additional-config '{{\"kvmix\": ...}}') but "
                      f"vLLM is picking its {name} attention backend, which would ignore it: "
                      "start vLLM with --attention-backend CUSTOM")

    return type(backend.__name__, (backend,), {
        "validate_configuration": classmethod(validate_configuration),
        "__module__": backend.__module__, "__qualname__": backend.__qualname__})
