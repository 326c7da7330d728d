"""Model architectures for planning without the weights: bundled configs of common open models
(the public facts of their ``config.json``), or any ``config.json`` a user has."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmix.methods import ModelSpec

CONFIGS = Path(__file__).with_name("configs")
FULL, SLIDING = "full_attention", "sliding_attention"
REQUIRED = ("num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size",
            "vocab_size")


@dataclass(frozen=True)
class Architecture:
    """What sizes a decoder's weights and KV cache."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    max_positions: int | None

    @property
    def parameters(self) -> int:
        """Embeddings, attention, a gated MLP and norms: how transformers counts a Llama-like."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        if self.bias:
            attention += self.head_dim * (self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embeddings = self.vocab * self.hidden * (1 if self.tied else 2)
        return embeddings + self.layers * layer + self.hidden

    def spec(self) -> ModelSpec:
        """The ModelSpec a method binds to (rotate-half pairs: the layout does not move bytes)."""
        half = self.head_dim // 2
        pairs = torch.stack([torch.arange(half), torch.arange(half, self.head_dim)], 1)
        return ModelSpec(self.layers, self.heads, self.kv_heads, self.head_dim, pairs, None,
                         self.name)


def bundled() -> list[str]:
    return sorted(p.stem for p in CONFIGS.glob("*.json"))


def architecture(model: str) -> Architecture:
    """A bundled name (``qwen3-8b``, ...) or the path of a ``config.json``."""
    if model in bundled():
        return from_config(json.loads((CONFIGS / f"{model}.json").read_text()), model)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        return from_config(json.loads(path.read_text()), str(model))
    raise ValueError(f"model={model!r} is neither a bundled config ({', '.join(bundled())}) nor "
                     "a config.json")


def from_config(config: dict[str, Any], name: str) -> Architecture:
    """A transformers config.json (a multimodal one's ``text_config`` is the decoder)."""
    text = config.get("text_config") or config
    missing = [key for key in REQUIRED if text.get(key) is None]
    if missing:
        raise ValueError(f"config of {name!r} lacks {', '.join(missing)}: kvmix needs a decoder's "
                         "layer count, widths, attention heads and vocabulary to plan")
    heads = text["num_attention_heads"]
    layers = text["num_hidden_layers"]
    return Architecture(
        name=config.get("_name_or_path") or name, layers=layers, hidden=text["hidden_size"],
        heads=heads, kv_heads=text.get("num_key_value_heads") or heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // heads,
        intermediate=text["intermediate_size"], vocab=text["vocab_size"],
        tied=bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
        bias=bool(text.get("attention_bias", False)), layer_types=_layer_types(text, layers),
        sliding_window=text.get("sliding_window"),
        max_positions=text.get("max_position_embeddings"))


def _layer_types(text: dict[str, Any], layers: int) -> tuple[str, ...]:
    if text.get("layer_types"):
        return tuple(text["layer_types"])
    pattern = text.get("sliding_window_pattern")
    if text.get("sliding_window") and pattern:  # Gemma-3: every pattern-th layer is global
        return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(layers))
    if text.get("sliding_window") and text.get("use_sliding_window", True):
        return (SLIDING,) * layers  # Mistral: a window and no layer types, as transformers reads it
    return (FULL,) * layers
