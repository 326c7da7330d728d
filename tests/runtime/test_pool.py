"""The paged pool under the batch: one op call per layer step, no host syncs, shared pages,
fixed capacity refused before anything changes."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FAST, D, compare_batched, make, prefill, step, tokens
from torch.utils._python_dispatch import TorchDispatchMode

from kvmix.core.memory import reachable_bytes
from kvmix.runtime.kernels import cpu
from kvmix.runtime.layer import take_pending

pytestmark = pytest.mark.skipif(not cpu.available()[0], reason="the CPU op is not built")



@pytest.mark.parametrize("name", FAST)
def test_one_batched_call_matches_the_reference_on_a_ragged_batch(name):
    compare_batched(name, "cpu", steps=30)


class Calls(TorchDispatchMode):
    """Counts the ops dispatched inside the block, kvmix's decode calls apart (its encoder's
    ``quantize`` and ``pack`` run where a step seals pages)."""

    def __init__(self):
        super().__init__()
        self.ops, self.kvmix = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        self.kvmix += func.namespace == "kvmix" and func.__name__.startswith("decode")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "wush"])
def test_calls_per_layer_step_do_not_grow_with_the_batch(name):
    """Ops dispatched per layer step (flushes included), the pool sized up front."""
    counts = {}
    for batch in (1, 4, 16):
        cache = make(name, backend="cpu", max_batch=batch, max_tokens=80)
        prefill(cache, [40] * batch)
        calls = []
        for i in range(20):  # group 8: pages sealed at two of the steps
            staged = tokens(batch, 1, 50 + i, dtype=torch.float32)
            with Calls() as mode:
                step(cache, batch, 0, staged)
            calls.append((mode.kvmix, mode.ops))
        counts[batch] = calls
    assert all(kvmix == 1 for kvmix, _ in counts[1])  # one op call per layer step
    assert counts[4] == counts[16]
    # batch 1 may take broadcasting views more at a flush, and one op fewer elsewhere
    assert all(one[1] + 1 >= four[1] for one, four in zip(counts[1], counts[4], strict=True))


@pytest.mark.parametrize("name, ops", [("kivi2", {"quantize"}),  # packed as it quantizes
                                       # both key planes in one pass, from the selection's
                                       # channels; values packed as they are quantized
                                       ("pnmix1", {"quantize_mixed", "selected_channels",
                                                   "quantize"})])
def test_pages_sealed_on_the_cpu_backend_go_through_the_ops_encoder(name, ops):
    """A flush's encode runs in the op library's encoder (bit for bit torch's: the reference
    comparisons of this module hold it to what the torch path stores)."""
    cache = make(name, backend="cpu", max_batch=2, max_tokens=80)
    prefill(cache, [40, 40])

    class Encoder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "kvmix":
                self.seen.add(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    with Encoder() as mode:
        for i in range(10):  # group 8: a page sealed on the way
            step(cache, 2, i, tokens(2, 1, 50 + i, dtype=torch.float32))
    assert ops | {"decode_batch"} <= mode.seen


class Syncs:
    """Counts Tensor.item, Tensor.tolist and Tensor.__bool__ calls while patched."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("item", "tolist", "__bool__"):
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(real))

    def _counted(self, real):
        def counted(tensor, *args, **kwargs):
            self.count += 1
            return real(tensor, *args, **kwargs)
        return counted


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "ggml", "full"])
def test_decode_steps_of_a_padded_batch_never_sync(name, backend, monkeypatch):
    cache = make(name, backend=backend)
    prefill(cache, [37, 12, 25, 3])
    syncs = Syncs(monkeypatch)
    for i in range(20):
        step(cache, 4, 200 + i)
    assert syncs.count == 0
    monkeypatch.undo()
    assert cache.layers[0].rows[0].lengths  # pages were sealed during the steps


def test_a_non_finite_decode_step_is_caught_at_the_next_check():
    cache = make("kivi2", backend="cpu")
    prefill(cache, [20, 20])
    keys, values, queries = tokens(2, 1, 7, dtype=torch.float32)
    keys[1, 0, 0, 3] = float("nan")
    cache.update(keys, values, 0)
    take_pending().attend(queries, None, D**-0.5)
    with pytest.raises(ValueError, match="non-finite keys or values in layer 0"):
        cache.check()
    cache.check()  # read once: the flag is spent


def test_beams_share_sealed_pages_and_bytes_count_them_once():
    cache = make("kivi2", backend="cpu")
    prefill(cache, [45, 45])
    pool = cache.layers[0].pool
    used = pool.used
    cache.batch_repeat_interleave(3)
    assert pool.used == used  # no page copied
    assert max(pool.refs) == 3
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()
    for i in range(10):
        step(cache, 6, 300 + i)
    cache.batch_select_indices(torch.tensor([0]))
    assert sorted(set(range(pool.capacity)) - set(pool.free)) == sorted(
        cache.layers[0].store.pages[0])  # every other page returned to the pool
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()


def test_the_pool_grows_by_a_quarter_and_never_reconcatenates():
    cache = make("kivi2", backend="cpu")
    prefill(cache, [20])
    pool = cache.layers[0].pool
    grown = []
    for i in range(200):
        version = pool.version
        step(cache, 1, 400 + i)
        if pool.version != version:
            grown.append(pool.capacity)
    assert len(grown) >= 3
    assert all(b == max(a + 1, -(-a * 5 // 4)) for a, b in itertools.pairwise(grown))
    assert pool.used <= pool.capacity <= 1.25 * pool.used + 1


def test_a_fixed_pool_refuses_before_anything_changes():
    """max_batch/max_tokens size the pool; beyond it: an error naming the capacity, and the
    cache holds exactly what it held."""
    with pytest.raises(ValueError, match="max_batch=2"):
        prefill(make("kivi2", backend="cpu", max_batch=2, max_tokens=64), [10, 10, 10])
    # sink 4 + residual 16: 40 tokens seal 3 pages of 8 per sequence
    cache = make("kivi2", backend="cpu", max_batch=2, max_tokens=40)
    prefill(cache, [40, 40])
    assert cache.layers[0].pool.capacity == 6
    before = [row.history(torch.float32) for row in cache.layers[0].rows]
    with pytest.raises(ValueError, match="max_pages=6"):
        for i in range(8):
            step(cache, 2, 500 + i)
    after = [row.history(torch.float32) for row in cache.layers[0].rows]
    assert all(len(row) == cache.get_seq_length() for row in cache.layers[0].rows)
    assert all(torch.equal(a[0], b[0][..., : a[0].shape[-2], :]) for a, b in zip(
        before, after, strict=True))
    with pytest.raises(ValueError, match="give both"):
        make("kivi2", max_batch=2)
