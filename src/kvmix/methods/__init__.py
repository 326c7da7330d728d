"""The method registry: every method is one module here, found by name.

Method strings are ``name`` or ``name:param=value,param=value``; presets (``kivi2``) are names
with fixed parameters. Per-layer lists are written with ``/``: ``key_bits=4/4/2``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvmix.methods.base import (
    Blocks,
    ChannelKeys,
    KernelView,
    Method,
    ModelSpec,
    Plane,
    TokenGroups,
)
from kvmix.methods.registry import _METHODS, _PRESETS, register


def method_names() -> list[str]:
    return sorted(_METHODS) + sorted(_PRESETS)


def method_classes() -> dict[str, type[Method]]:
    return dict(_METHODS)


def presets() -> dict[str, tuple[type[Method], dict[str, Any]]]:
    return dict(_PRESETS)


def parameters(cls: type[Method]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def parse_method(text: str | Method) -> Method:
    """``"kxvy:key_bits=4,value_bits=2"`` -> a validated Method instance."""
    if isinstance(text, Method):
        return text
    name, _, rest = text.strip().partition(":")
    if name in _PRESETS:
        cls, params = _PRESETS[name]
    elif name in _METHODS:
        cls, params = _METHODS[name], {}
    else:
        raise ValueError(f"unknown method {name!r}; valid methods: {', '.join(method_names())}")
    params = {**params, **_parse_overrides(rest, cls)}
    return cls(**params)


def split_methods(text: str) -> list[str]:
    """Split a comma-separated method list; ``a=b`` pieces belong to the method before them
    (its overrides, or the vLLM plugin's settings after an ``@``: ``kivi2@values=token``)."""
    out: list[str] = []
    for piece in filter(None, (p.strip() for p in text.split(","))):
        key = piece.partition("=")[0]
        if "=" in piece and ":" not in key and "@" not in key and out:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


def _parse_overrides(text: str, cls: type[Method]) -> dict[str, Any]:
    valid = parameters(cls)
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, eq, raw = item.partition("=")
        key = key.strip()
        if not eq:
            raise ValueError(f"override {item!r} of method {cls.name!r} must be param=value")
        if key not in valid:
            raise ValueError(
                f"unknown parameter {key!r} for method {cls.name!r}; valid: {', '.join(valid)}"
            )
        out[key] = _literal(raw.strip())
    return out


def _literal(raw: str) -> Any:
    parts = raw.split("/")
    if len(parts) > 1 and all(isinstance(_literal(p), (int, float)) for p in parts):
        return tuple(_literal(p) for p in parts)  # a per-layer list; other slashes: a path
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for kind in (int, float):
        try:
            return kind(raw)
        except ValueError:
            pass
    return raw


# One line per method module: importing it registers it.
from kvmix.methods import (  # noqa: E402, F401
    chanmix,
    fp8,
    full,
    ggml,
    kitty,
    kivi,
    kxvy,
    pertoken,
    pnmix,
    polar,
    wush,
)

__all__ = [
    "Blocks",
    "ChannelKeys",
    "KernelView",
    "Method",
    "ModelSpec",
    "Plane",
    "TokenGroups",
    "method_classes",
    "method_names",
    "parameters",
    "parse_method",
    "presets",
    "register",
    "split_methods",
]
