"""Memory that is really kept alive: bytes of distinct storages, never ``numel`` of views.

A view pins its whole base storage (a zero-length slice of a prompt tensor keeps the prompt), so
what an object holds is the sum over the *distinct storages* its tensors point into, each
counted once. ``owned`` gives a tensor its own storage when it is a view into a larger one.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import torch

ATOMS = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device)


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    storage = t.untyped_storage()
    return str(t.device), storage.data_ptr()


def storage_bytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def owned(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when it fills its own storage, else a compact copy that does."""
    exact = t.storage_offset() == 0 and t.is_contiguous()
    if exact and storage_bytes(t) == t.numel() * t.element_size():
        return t
    return t.clone(memory_format=torch.contiguous_format)


def kind_bytes(tagged: list[tuple[str, torch.Tensor]]) -> Counter:
    """Bytes per kind of (kind, tensor) pairs, every storage counted once (first kind wins)."""
    seen: set[tuple[str, int]] = set()
    total: Counter = Counter()
    for kind, t in tagged:
        key = storage_key(t)
        if key not in seen:
            seen.add(key)
            total[kind] += storage_bytes(t)
    return total


def reachable_bytes(root: Any) -> int:
    """Bytes of every distinct tensor storage reachable from ``root`` through attributes,
    dataclass fields, lists, tuples, sets and dict values (modules and classes are not walked).

    Independent of any object's own accounting: a check that nothing is held unawares."""
    seen: set[int] = set()
    storages: dict[tuple[str, int], int] = {}
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, ATOMS):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storages[storage_key(obj)] = storage_bytes(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif not isinstance(obj, (type, torch.nn.Module)) and not callable(obj):
            stack.extend(_attributes(obj))
    return sum(storages.values())


def _attributes(obj: Any) -> list[Any]:
    if dataclasses.is_dataclass(obj):
        fields = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
        return fields + list(getattr(obj, "__dict__", {}).values())
    values = list(getattr(obj, "__dict__", {}).values())
    for slot in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, slot):
            values.append(getattr(obj, slot))
    return values
