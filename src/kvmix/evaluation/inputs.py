"""What every evaluating command takes (``JobConfig``) and loads before its work: the model and
the first tokens of its text, a bad backend or data source refused before the model loads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvmix.evaluation.data import load_text, token_ids
from kvmix.models.loading import DEFAULT_MODEL, LoadedModel, load_model
from kvmix.runtime.kernels import BACKENDS


@dataclass
class JobConfig:
    """What every command takes: the model, the text, precision, device and output folder."""

    model: str = DEFAULT_MODEL
    data: str = "prose"
    dtype: str = "auto"
    device: str = "cpu"
    backend: str = "auto"
    out: str | None = None


def load_inputs(config: Any, n_tokens: int,
                loaded: LoadedModel | None = None) -> tuple[LoadedModel, torch.Tensor]:
    """The model (unless given) and the first ``n_tokens`` tokens of ``config.data``: [1, n].
    A bad backend name fails here, before the model loads."""
    check_backend(config.backend)
    loaded = loaded or load_model(config.model, config.dtype, config.device)
    text = load_text(config.data)
    return loaded, token_ids(loaded.tokenizer, text, n_tokens, f"data={config.data!r}")


def check_inputs(config: Any) -> None:
    """A bad backend name or data source is refused before any model loads."""
    check_backend(config.backend)
    load_text(config.data)


def check_backend(backend: str | list[str]) -> None:
    for name in [backend] if isinstance(backend, str) else backend:
        if name not in BACKENDS:
            raise ValueError(f"backend={name!r} is invalid; valid: {', '.join(BACKENDS)}")
