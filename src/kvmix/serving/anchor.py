"""transformers' own continuous batching with its paged float cache (SDPA), sized to the same
bytes as a kvmix server: the anchor ``kvmix serve`` and ``kvmix loadtest`` are measured
against. Both managers record the same step figures (``Measured``)."""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching import ContinuousBatchingManager

from kvmix.serving.budget import size_refusal
from kvmix.serving.stats import Stats

PAGE = 256  # transformers' default page of tokens


class Measured:
    """A ContinuousBatchingManager mixin: ``stats`` after every forward of its loop."""

    stats: Stats

    def _generation_step(self) -> None:
        super()._generation_step()
        self.stats.record(self.batch_processor)

    def _generation_loop_body(self, batch_processor: Any, bootstrapping: bool) -> bool:
        go_on = super()._generation_loop_body(batch_processor, bootstrapping)
        self.stats.refresh(batch_processor)
        return go_on


def greedy(model: Any, max_new_tokens: int) -> GenerationConfig:
    """The generation every served request gets: greedy, ``max_new_tokens`` unless it asks."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    return GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                            eos_token_id=-1 if eos is None else eos)


class TransformersManager(Measured, ContinuousBatchingManager):
    """transformers' manager, cache and scheduler as they ship, with ``memory`` bytes of paged
    float cache (``num_blocks`` of ``PAGE`` tokens in every layer)."""

    def __init__(self, model: Any, memory: float, max_new_tokens: int = 128,
                 max_batch_tokens: int = 2048):
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
        self.stats = Stats()
        super().__init__(model, greedy(model, max_new_tokens), ContinuousBatchingConfig(
            num_blocks=self.blocks, page_size=PAGE, max_batch_tokens=max_batch_tokens,
            use_async_batching=False, use_cuda_graph=False, auto_switch_to_flash=False))

    def refusal(self, prompt: int, new_tokens: int | None) -> str | None:
        why = size_refusal(prompt, new_tokens, self.positions)
        if why:
            return why
        pages = -(-(prompt + new_tokens) // PAGE)
        if pages > self.blocks:
            return (f"the request needs {pages} pages of {PAGE} tokens, beyond the cache's "
                    f"{self.blocks}")
        return None
