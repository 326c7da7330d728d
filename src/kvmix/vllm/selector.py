"""The class vLLM resolves for an attention backend kvmix stands in for: kvmix's backend when
vLLM's configuration names a kvmix method, else vLLM's own class, unchanged.

vLLM loads plugins before it has a configuration, and on CPU it picks ``CPU_ATTN`` whatever
``--attention-backend`` says; so the plugin points that member at this module (``register``)
and the choice is made here, when vLLM resolves the class while it builds the model.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    from vllm.config import get_current_vllm_config
    from vllm.utils.import_utils import resolve_obj_by_qualname
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from kvmix.vllm.settings import requested

    if name not in AttentionBackendEnum.__members__:
        raise AttributeError(name)
    config = get_current_vllm_config()
    if requested(config) is not None:
        from kvmix.vllm.backend import backend_for

        return backend_for(config)
    path = AttentionBackendEnum[name].value
    if not path:
        raise ValueError(f"--attention-backend {name} is kvmix's backend: name a kvmix method "
                         """in --additional-config '{"kvmix": {"method": "kivi2"}}'""")
    return resolve_obj_by_qualname(path)
