"""Walk the tensors held in (nested) dataclasses: batch ops and byte accounting share it.

Every tensor kvmix stores has the batch as dimension 0, so one function applied to all of them
implements beam reordering, batch repetition and batch selection. A dataclass field may name its
storage kind in ``metadata["kind"]`` (codes, scales, zeros, masks); bare tensors take the kind
the caller gives (``kvmix.core.memory`` turns them into bytes of distinct storages).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Return ``obj`` with ``fn`` applied to every tensor it holds."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj)}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(x, fn) for x in obj)
    return obj


def combine(parts: list[Any], fn: Callable[[list[torch.Tensor]], torch.Tensor]) -> Any:
    """Merge structures of the same shape tensor by tensor (the first gives the structure)."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return fn(parts)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        changes = {f.name: combine([getattr(p, f.name) for p in parts], fn)
                   for f in dataclasses.fields(first)}
        return dataclasses.replace(first, **changes)
    if isinstance(first, (list, tuple)):
        return type(first)(combine(list(items), fn) for items in zip(*parts, strict=True))
    return first


def tagged_tensors(obj: Any, kind: str) -> list[tuple[str, torch.Tensor]]:
    """(storage kind, tensor) for every tensor in ``obj`` (``kind`` for untagged tensors)."""
    if isinstance(obj, torch.Tensor):
        return [(kind, obj)]
    found: list[tuple[str, torch.Tensor]] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found += tagged_tensors(getattr(obj, f.name), f.metadata.get("kind", kind))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            found += tagged_tensors(x, kind)
    return found


def tensor_paths(obj: Any, path: tuple = ()) -> list[tuple]:
    """Where each tensor of ``obj`` lies (its fields' names and list indices), in
    ``tagged_tensors``' order: a structure's shape read once, its tensors then fetched cheaply
    (``at_paths``) from any structure of that shape."""
    if isinstance(obj, torch.Tensor):
        return [path]
    found: list[tuple] = []
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            found += tensor_paths(getattr(obj, f.name), (*path, f.name))
    elif isinstance(obj, (list, tuple)):
        for i, x in enumerate(obj):
            found += tensor_paths(x, (*path, i))
    return found


def at_paths(obj: Any, paths: list[tuple]) -> list[torch.Tensor]:
    """The tensors of ``obj`` at ``paths`` (``tensor_paths`` of a structure of its shape)."""
    found = []
    for path in paths:
        x = obj
        for step in path:
            x = x[step] if isinstance(step, int) else getattr(x, step)
        found.append(x)
    return found
