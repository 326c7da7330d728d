"""kvmix inside vLLM: kvmix's packed KV formats as a vLLM attention backend (SPEC §13).

Installed with ``pip install 'kvmix[vllm]'``; vLLM finds ``register`` through the
``vllm.general_plugins`` entry point in each of its processes. Nothing changes unless vLLM's
configuration names a method::

    python -m vllm.entrypoints.openai.api_server --model DIR --dtype float32 \\
        --additional-config '{"kvmix": {"method": "pnmix1"}}'

The layers: ``settings`` (what is asked, checked before the engine starts), ``pages`` (kvmix's
pages in vLLM's KV tensor), ``plan`` (a step, planned once for every layer), ``layer`` (a
layer's pages and staging), ``backend`` (vLLM's classes), ``selector`` (kvmix's backend or
vLLM's own). Nothing in kvmix imports this package.
"""

from __future__ import annotations

SELECTOR = "kvmix.vllm.selector"


def register() -> None:
    """Point vLLM's CPU backend (always chosen on CPU) and ``CUSTOM`` (``--attention-backend
    CUSTOM`` on CUDA) at kvmix's selector, which resolves to vLLM's own class unless kvmix is
    configured. Safe to call more than once."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM):
        register_backend(member, f"{SELECTOR}.{member.name}")
