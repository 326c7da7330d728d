"""kvmix's attention backend for vLLM: the classes vLLM's attention layers and model runner
call (``AttentionBackend``, its metadata builder and its implementation), thin over
``kvmix.vllm.plan`` (a step planned once) and ``kvmix.vllm.layer`` (each layer's pages and
staging).

vLLM allocates each layer's KV tensor as uint8 of the method's page size (``customize_spec``),
so its scheduler admits requests by packed bytes; the backend updates the cache inside
``forward`` (the sealing of a group reads the step's queries, for PN-Mix's selection).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import numpy as np
import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from kvmix.vllm import SELECTOR
from kvmix.vllm.layer import (
    LayerCache,
    OpenGroups,
    kernel_choice,
    readers,
    staging_nbytes,
    token_values_unserved,
)
from kvmix.vllm.pages import page_layout
from kvmix.vllm.plan import Planner, StepPlan, idle_plan
from kvmix.vllm.settings import Refused, Settings, resolve

logger = logging.getLogger("vllm.kvmix")  # under vLLM's logger: in `vllm serve`'s log
NULL_BLOCK = 0  # vLLM's block pool never hands block 0 to a request


_BOUND: dict[tuple, type[KvmixBackend]] = {}


def backend_for(vllm_config: VllmConfig) -> type[KvmixBackend]:
    """kvmix's backend class bound to the settings of ``vllm_config`` (one class per engine
    configuration: vLLM calls some of a backend's methods with no configuration at hand, such
    as ``customize_spec`` while it sizes the cache)."""
    settings = resolve(vllm_config)
    key = (settings.text, settings.staging_dtype, settings.values, settings.dtype,
           vllm_config.model_config.model,
           settings.spec.name, settings.spec.n_heads, settings.spec.n_kv_heads)
    if key not in _BOUND:
        _BOUND[key] = type("KvmixBackend", (KvmixBackend,), {"settings": settings})
    return _BOUND[key]


@functools.cache
def page_bytes(settings: Settings, dtype: torch.dtype) -> int:
    """Bytes of one kvmix page: the widest layer's (per-layer widths share vLLM's page)."""
    return max(page_layout(settings.method, settings.spec, layer, dtype).page_bytes
               for layer in range(settings.spec.n_layers))


class KvmixBackend(AttentionBackend):
    """kvmix's packed formats as a vLLM attention backend (CPU: kvmix's fused op; CUDA, with
    ``--attention-backend CUSTOM``: its Triton kernels)."""

    settings: ClassVar[Settings]  # set on the class ``backend_for`` makes
    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16,
                                                     torch.float32]
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto"]

    @staticmethod
    def get_name() -> str:
        # the registry member this class stands in for (vLLM maps the name back to it), on the
        # platform in force when asked
        from vllm.platforms import current_platform

        return "CPU_ATTN" if current_platform.is_cpu() else "CUSTOM"

    @classmethod
    def full_cls_name(cls) -> tuple[str, str]:
        # vLLM's CUDA platform imports the selected class again from this path: the selector's
        # member, which resolves to this class again under the engine's configuration
        return SELECTOR, cls.get_name()

    @staticmethod
    def get_impl_cls() -> type[KvmixImpl]:
        return KvmixImpl

    @staticmethod
    def get_builder_cls() -> type[KvmixMetadataBuilder]:
        return KvmixMetadataBuilder

    @classmethod
    def get_supported_kernel_block_sizes(cls, kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(cls.settings.group)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)  # each layer's bytes in one run: its pages field by field

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        """uint8 pages of the method's size: one vLLM "state" is one kvmix page (``group``
        tokens of every KV head), ``block_size / group`` of them a block, in one head slot —
        a block takes exactly its pages' bytes."""
        settings = cls.settings
        if spec.block_size % settings.group:
            raise Refused(f"vLLM's block size {spec.block_size} is not a multiple of "
                          f"{settings.method.name}'s group={settings.group}: a block holds whole "
                          f"groups (use --block-size {settings.group} or a multiple)")
        return replace(spec, dtype=torch.uint8, num_head_slots=1, tokens_per_state=settings.group,
                       state_content_bytes=page_bytes(settings, settings.dtype))


@dataclass
class KvmixMetadata:
    """A step's plan and its token count (what every layer's ``forward`` reads)."""

    plan: StepPlan
    num_actual_tokens: int


class KvmixMetadataBuilder(AttentionMetadataBuilder[KvmixMetadata]):
    """Plans each step once for every layer (``Planner``: its staging slots committed once the
    step has run)."""

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.settings = settings = resolve(vllm_config)
        plans_for = readers(settings, kv_cache_spec.block_size, device)
        self.planner = Planner(plans_for, vllm_config.scheduler_config.max_num_seqs, device)
        self.idle = idle_plan(plans_for, device)
        logger.info("%s", startup_line(vllm_config, settings, kv_cache_spec, device))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> KvmixMetadata:
        meta, rows = common_attn_metadata, common_attn_metadata.num_reqs
        starts = meta.query_start_loc_cpu[: rows + 1].numpy().astype(np.int64)
        lengths = meta.seq_lens_cpu_upper_bound if meta.seq_lens_cpu_upper_bound is not None \
            else meta.seq_lens
        table = meta.block_table_tensor[:rows].cpu().numpy().astype(np.int64)
        requests = getattr(meta, "req_idx", None)
        if rows and (table[:, 0] == NULL_BLOCK).all():
            # a dummy batch (vLLM's warm-up, profile and graph-capture runs: every row on the
            # null block): attends to nothing, changes nothing
            return KvmixMetadata(self.idle, meta.num_actual_tokens)
        plan = self.planner.plan(starts, lengths.cpu().numpy().astype(np.int64)[:rows], table,
                                 None if requests is None else np.asarray(requests)[:rows])
        return KvmixMetadata(plan, meta.num_actual_tokens)


class KvmixImpl(AttentionImpl[KvmixMetadata]):
    """One attention layer: refuses at start-up what it cannot honour, then runs each step on
    its ``LayerCache`` (made at the layer's first step, when its name is known)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 alibi_slopes: list[float] | None, sliding_window: int | None,
                 kv_cache_dtype: str, logits_soft_cap: float | None = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, **extra: Any):
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        config = get_current_vllm_config()
        self.settings = resolve(config)
        refuse(config, self.settings, head_size=head_size, num_heads=num_heads,
               num_kv_heads=num_kv_heads, sliding_window=sliding_window,
               kv_cache_dtype=kv_cache_dtype, logits_soft_cap=logits_soft_cap,
               alibi_slopes=alibi_slopes, attn_type=attn_type,
               kv_sharing_target_layer_name=kv_sharing_target_layer_name,
               sinks=extra.get("sinks"))
        self.dtype = config.model_config.dtype
        self.slots = config.scheduler_config.max_num_seqs
        self.block_size = config.cache_config.block_size
        # the staging now, while vLLM builds the model: inside the memory it profiles
        self.device = torch.device(config.device_config.device)
        self.open_groups = OpenGroups.allocate(self.settings, self.slots, self.device)
        self.cache: LayerCache | None = None

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor, attn_metadata: KvmixMetadata,
                output: torch.Tensor, output_scale: torch.Tensor | None = None,
                output_block_scale: torch.Tensor | None = None) -> torch.Tensor:
        # query: [N, Hq, D]; key, value: [N, H, D]; output: [N, Hq, D]
        if attn_metadata is None:  # vLLM's warm-up and profiling runs
            return output
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("kvmix: fused output quantization is not supported")
        cache = self._cache(layer, kv_cache)
        plan = attn_metadata.plan
        n = plan.tokens  # the step's tokens (any padding vLLM adds is after them)
        if n == query.shape[0]:
            cache.step(plan, query, key, value, self.scale, output)
        else:
            cache.step(plan, query[:n], key[:n], value[:n], self.scale, output[:n])
        return output

    def _cache(self, layer: AttentionLayer, kv_cache: torch.Tensor) -> LayerCache:
        if self.cache is None:
            self.cache = LayerCache(self.settings, extract_layer_index(layer.layer_name),
                                    self.dtype, self.slots, self.block_size, kv_cache.device,
                                    self.open_groups)
        self.cache.bind(kv_cache)
        return self.cache


def startup_line(config: VllmConfig, settings: Settings, spec: AttentionSpec,
                 device: torch.device) -> str:
    """What the plugin set up, for vLLM's log: method, bits, page bytes, the tokens the cache
    holds (when vLLM has sized it in this process), the staging and the kernels."""
    method, slots = settings.method, config.scheduler_config.max_num_seqs
    keys, values = max((method.bits(layer, settings.dtype)
                        for layer in range(settings.spec.n_layers)), key=sum)
    blocks = config.cache_config.num_gpu_blocks
    held = f"{blocks} blocks of {spec.block_size} = {blocks * spec.block_size} tokens a rank" \
        if blocks else "blocks as vLLM sizes them"
    chosen = kernel_choice(settings, device)
    return (f"kvmix: {settings.text} ({keys:.2f} bits a key element, {values:.2f} a value; "
            f"{settings.spec.n_kv_heads} KV heads a rank) in vLLM's cache: "
            f"{page_bytes(settings, settings.dtype)} bytes a page of {settings.group} tokens, "
            f"{held}; float staging ({str(settings.staging_dtype).removeprefix('torch.')}) of each "
            f"running sequence's open group"
            f"{'' if settings.staged_values else ' (keys; values to pages as they come)'}: "
            f"{slots} sequences, "
            f"{staging_nbytes(settings, slots) / 2**20:.1f} MiB; kernels: {chosen}")


def refuse(config: VllmConfig, settings: Settings, **layer: Any) -> None:
    """``Refused`` naming the first setting of vLLM or of the layer kvmix cannot honour."""
    method = settings.method
    token = "" if settings.staged_values else token_values_unserved(
        settings, torch.device(config.device_config.device))
    checks = [
        (layer["kv_cache_dtype"] != "auto",
         f"--kv-cache-dtype {layer['kv_cache_dtype']} on top of kvmix's own packed format "
         "(use the default, auto)"),
        (layer["sliding_window"] is not None,
         f"a sliding window of {layer['sliding_window']} tokens (kvmix's vLLM backend masks none)"),
        (layer["logits_soft_cap"] not in (None, 0), "attention logit soft-capping"),
        (layer["alibi_slopes"] is not None, "ALiBi slopes"),
        (layer["sinks"] is not None, "learned attention sinks"),
        (layer["attn_type"] != AttentionType.DECODER,
         f"attention of type {layer['attn_type']} (decoder self-attention only)"),
        (layer["kv_sharing_target_layer_name"] is not None, "KV sharing between layers"),
        (layer["head_size"] != settings.spec.head_dim,
         f"head size {layer['head_size']} (the model config says {settings.spec.head_dim})"),
        (config.speculative_config is not None, "speculative decoding"),
        (getattr(config.parallel_config, "use_ubatching", False),
         "micro-batching (--enable-dbo or --ubatch-size: kvmix plans one batch a step)"),
        (config.kv_transfer_config is not None,
         "a KV connector (it copies blocks' bytes; kvmix lays a layer's pages out field by "
         "field)"),
        (layer["num_kv_heads"] != settings.spec.n_kv_heads
         or layer["num_heads"] != settings.spec.n_heads,
         f"{layer['num_heads']} query and {layer['num_kv_heads']} KV heads in this layer (vLLM's "
         f"configuration gives {settings.spec.n_heads} and {settings.spec.n_kv_heads} a rank)"),
        (getattr(config.cache_config, "enable_extensible_kv_cache", False),
         "vLLM's extensible KV cache (kvmix lays a layer's pages out field by field across the "
         "layer's whole tensor, past the blocks it commits): start vLLM with "
         "--no-enable-extensible-kv-cache, or size the cache with --kv-cache-memory-bytes or "
         "--num-gpu-blocks-override"),
        (settings.prefill == "exact" and config.cache_config.enable_prefix_caching,
         "prefix caching and prefill='exact' (a cached prefix would start a prompt's first "
         "computed chunk past its first token, attending as decodes: disable prefix caching)"),
        (config.cache_config.block_size % settings.group != 0,
         f"--block-size {config.cache_config.block_size}, not a multiple of "
         f"{method.name}'s group={settings.group}"),
        (bool(token), f"values='token' here: {token}"),
    ]
    for failed, what in checks:
        if failed:
            raise Refused(f"kvmix method {settings.text!r} cannot run with {what}")
