"""Where method classes are registered by name (a method module's ``@register``), with their
presets; ``kvmix.methods`` imports every method module and finds them here."""

from __future__ import annotations

from typing import Any

from kvmix.methods.base import Method

_METHODS: dict[str, type[Method]] = {}
_PRESETS: dict[str, tuple[type[Method], dict[str, Any]]] = {}


def register(cls: type[Method]) -> type[Method]:
    _METHODS[cls.name] = cls
    for preset, params in cls.presets.items():
        _PRESETS[preset] = (cls, params)
    return cls
