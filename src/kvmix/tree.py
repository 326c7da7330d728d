"""Walk the tensors held in (nested) dataclasses: batch ops and byte accounting share it.

Every tensor kvmix stores has the batch as dimension 0, so one function applied to all of them
implements beam reordering, batch repetition and batch selection. A dataclass field may name its
storage kind in ``metadata["kind"]`` (codes, scales, zeros, masks); bare tensors take the kind
the caller gives.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
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


def zip_tensors(a: Any, b: Any, fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> Any:
    """Combine two structures of the same shape tensor by tensor (``a`` gives the structure)."""
    if isinstance(a, torch.Tensor):
        return fn(a, b)
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        changes = {f.name: zip_tensors(getattr(a, f.name), getattr(b, f.name), fn)
                   for f in dataclasses.fields(a)}
        return dataclasses.replace(a, **changes)
    if isinstance(a, (list, tuple)):
        return type(a)(zip_tensors(x, y, fn) for x, y in zip(a, b, strict=True))
    return a


def tensor_bytes(obj: Any, kind: str) -> Counter:
    """Bytes of every tensor in ``obj``, keyed by storage kind (``kind`` for untagged tensors)."""
    if isinstance(obj, torch.Tensor):
        return Counter({kind: obj.numel() * obj.element_size()})
    total: Counter = Counter()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            total += tensor_bytes(getattr(obj, f.name), f.metadata.get("kind", kind))
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            total += tensor_bytes(x, kind)
    return total
