"""Where kvmix keeps what it builds or converts once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """``$KVMIX_CACHE``, by default ``~/.cache/kvmix``: the CPU op's builds, the default
    model converted from its GGUF file, models saved for vLLM, llama.cpp's build."""
    return Path(os.environ.get("KVMIX_CACHE", Path.home() / ".cache" / "kvmix"))
