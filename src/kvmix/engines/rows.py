"""A command's rows name the engine that runs them by a prefix (``vllm:fp8``,
``llama.cpp:q8_0``); a row with no prefix is kvmix's own."""

from __future__ import annotations


def engine_rows(names: list[str], prefix: str) -> list[str]:
    """The rows among method or baseline ``names`` that ``prefix``'s engine runs."""
    return [name for name in names if name.startswith(prefix)]
