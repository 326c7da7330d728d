"""Devices without a GPU: every method's select/encode/decode/kernel view, and the layer's
update and attend, on ``meta`` tensors — where any tensor created on the CPU and mixed in fails
— so a tensor made on the wrong device is caught on every machine, not only on a GPU."""

from __future__ import annotations

import pytest
import torch
from helpers import GROUP, HQ, METHODS, D, H, feed, make

from kvmix.core.tree import map_tensors
from kvmix.methods import Blocks

# HQQ's quantizer reads values on the host (``.item()`` in its optimizer): not on meta tensors
ON_META = [m for m in METHODS if "backend=hqq" not in m]


def meta(x):
    return map_tensors(x, lambda t: t.to("meta"))


def on_meta(x) -> bool:
    tensors = []
    map_tensors(x, lambda t: tensors.append(t) or t)
    return bool(tensors) and all(t.is_meta for t in tensors)


@pytest.mark.parametrize("name", ON_META)
def test_a_methods_steps_run_on_the_device_of_their_inputs(name):
    """Prefill selection, encode, decode and the fused ops' view of one sequence's block."""
    method = make(name).method
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, 1, H, GROUP, D, generator=g)
    queries = torch.randn(1, HQ, GROUP, D, generator=g)
    selection = method.select(*meta((queries, keys)), 0, meta(values))
    stored = Blocks(*method.encode(*meta((keys, values)), 0, selection))
    assert on_meta(stored)
    blocks = map_tensors(stored, lambda t: t[:, None])  # [1, 1 block, ...]
    k, v = method.decode(blocks, 0, selection, torch.float32)
    assert k.is_meta and v.is_meta and k.shape == (1, 1, H, GROUP, D)
    view = method.kernel_view(blocks, 0, selection)
    assert view is None or on_meta(view)


@pytest.mark.parametrize("name", ON_META)
def test_the_layer_updates_and_attends_on_the_device_of_its_inputs(name):
    cache = make(name, backend="torch")
    prompt = feed(cache, 40, batch=2, device="meta")  # seals pages, flushes the residual
    step = feed(cache, 1, batch=2, device="meta")  # a decode step
    assert prompt.is_meta and step.is_meta
    assert on_meta(cache.layers[0].tensors())
    keys, values = cache.layers[0].rows[1].history(torch.float32)
    assert keys.is_meta and values.is_meta and keys.shape[-2] == 41
