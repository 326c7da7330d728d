"""transformers' own continuous batching with its paged float cache (SDPA), sized to the same
bytes as a kvmix server: the anchor ``kvmix serve`` and ``kvmix loadtest`` are measured
against. Both managers sample, record their figures and contain faults alike (``Served``)."""

from __future__ import annotations

from typing import Any

from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

from kvmix.serving.budget import size_refusal
from kvmix.serving.engine import Served, greedy

PAGE = 256  # transformers' default page of tokens


class TransformersManager(Served, ContinuousBatchingManager):
    """transformers' manager, cache and scheduler as they ship, with ``memory`` bytes of paged
    float cache (``num_blocks`` of ``PAGE`` tokens in every layer)."""

    def __init__(self, model: Any, memory: float, max_new_tokens: int = 128,
                 max_batch_tokens: int = 2048, cuda_graphs: bool = False):
        """cuda_graphs: transformers' own CUDA graphs of its decode steps (its
        ``use_cuda_graph``; a GPU setting)."""
        model.set_attn_implementation("sdpa")
        config = model.config.get_text_config(decoder=True)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // \
            config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.token_bytes = 2 * config.num_hidden_layers * kv_heads * head_dim * \
            model.dtype.itemsize
        self.blocks = int(memory // (self.token_bytes * PAGE))
        if self.blocks < 1:
            raise ValueError(f"memory={memory:.0f} bytes holds no page of {PAGE} tokens of "
                             f"float cache ({self.token_bytes * PAGE} bytes)")
        self.positions = getattr(config, "max_position_embeddings", None)
        self.max_batch_tokens = max_batch_tokens
        super().__init__(model, greedy(model, max_new_tokens), ContinuousBatchingConfig(
            num_blocks=self.blocks, page_size=PAGE, max_batch_tokens=max_batch_tokens,
            use_async_batching=False, use_cuda_graph=cuda_graphs, auto_switch_to_flash=False,
            return_logprobs=True))
        self._serve(model)

    def refusal(self, prompt: int, new_tokens: int | None, n: int = 1) -> str | None:
        why = size_refusal(prompt, new_tokens, self.positions)
        if why:
            return why
        pages = n * -(-(prompt + new_tokens) // PAGE)  # a fork copies its pages
        if pages > self.blocks:
            return (f"the request needs {pages} pages of {PAGE} tokens, beyond the cache's "
                    f"{self.blocks}")
        return None

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        return self._runner(super()._create_batch_processor())
