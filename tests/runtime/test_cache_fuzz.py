"""Random sequences of cache operations — prefill, decode of 1–40 tokens, crop, beam reorder,
repeat, select — against a reference that replays them on the unquantized tokens with plain
Python lists and quantizes its blocks with the method's own ``encode``: the decoded history
agrees bit for bit, and ``nbytes()`` is every storage reachable from the cache, after every
operation."""

from __future__ import annotations

import copy
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch
from helpers import GROUP, METHODS, SINK, D, H, expected_layout, make, tokens
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvmix.core.memory import reachable_bytes
from kvmix.core.tree import map_tensors
from kvmix.methods import Blocks
from kvmix.runtime.layer import take_pending

DTYPE = torch.float16


@dataclass
class Block:
    keys: torch.Tensor  # [1, H, G, D] the raw tokens the block was encoded from
    state: Blocks  # the method's encode of them, tensors [1, 1, ...]
    held: int


@dataclass
class ReferenceRow:
    """One sequence by the flush rule, written out on lists of tokens."""

    sink: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    blocks: list[Block] = field(default_factory=list)
    residual: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    selection: object = None
    started: bool = False

    def append(self, method, keys, values, queries) -> None:
        # keys, values: [1, H, q, D] (key space); queries [1, Hq, q, D]
        new = [(keys[:, :, t : t + 1], values[:, :, t : t + 1]) for t in range(keys.shape[2])]
        self.residual += new
        held = torch.cat([k for k, _ in self.residual], 2)
        held_values = torch.cat([v for _, v in self.residual], 2)
        if not self.started:
            self.selection, self.started = method.select(queries, held, 0, held_values), True
        else:
            self.selection = method.observe(self.selection, queries, keys, 0)
        while len(self.sink) < method.sink and not self.blocks and self.residual:
            self.sink.append(self.residual.pop(0))
        while len(self.residual) >= method.residual:
            part, self.residual = self.residual[:GROUP], self.residual[GROUP:]
            k, v = (torch.cat(x, 2) for x in zip(*part, strict=True))
            state = Blocks(*method.encode(k, v, 0, self.selection))
            self.blocks.append(Block(k, map_tensors(state, lambda t: t.unsqueeze(1)), GROUP))

    def truncate(self, length: int) -> None:
        self.sink, length = self.sink[:length], length - min(length, len(self.sink))
        kept = []
        for block in self.blocks:
            if length <= 0:
                break
            kept.append(Block(block.keys, block.state, min(block.held, length)))
            length -= kept[-1].held
        self.blocks, self.residual = kept, self.residual[:max(length, 0)]

    def history(self, method) -> tuple[torch.Tensor, torch.Tensor]:
        empty = torch.empty(1, H, 0, D, dtype=DTYPE)
        keys, values = [empty, *(k for k, _ in self.sink)], [empty, *(v for _, v in self.sink)]
        for block in self.blocks:  # each block decoded on its own
            k, v = method.decode(block.state, 0, self.selection, DTYPE)  # [1, 1, H, G, D]
            keys.append(k[:, 0, :, : block.held])
            values.append(v[:, 0, :, : block.held])
        keys += [k for k, _ in self.residual]
        values += [v for _, v in self.residual]
        return torch.cat(keys, 2), torch.cat(values, 2)


operations = st.lists(st.one_of(
    st.tuples(st.just("decode"), st.integers(1, 40)),
    st.tuples(st.just("crop"), st.integers(1, 30)),
    st.tuples(st.just("reorder"), st.lists(st.integers(0, 7), min_size=8, max_size=8)),
    st.tuples(st.just("repeat"), st.just(2)),
    st.tuples(st.just("select"), st.lists(st.booleans(), min_size=8, max_size=8)),
), min_size=1, max_size=8)


@pytest.mark.parametrize("name", METHODS)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.integers(1, 60), ops=operations, seed=st.integers(0, 10_000))
def test_cache_operations_match_a_replayed_reference(name, prompt, ops, seed):
    cache = make(name)
    method = cache.method
    reference = [ReferenceRow(), ReferenceRow()]
    step(cache, reference, prompt, seed)
    for op, arg in ops:
        batch = len(reference)
        if op == "decode":
            step(cache, reference, arg, seed + cache.get_seq_length())
        elif op == "crop":
            cache.crop(-arg)
            for row in reference:
                row.truncate(max(cache.get_seq_length(), 0))
        elif op == "reorder":
            index = [i % batch for i in arg[:batch]]
            cache.reorder_cache(torch.tensor(index))
            reference = [copy.deepcopy(reference[i]) for i in index]
        elif op == "repeat" and batch <= 4:
            cache.batch_repeat_interleave(arg)
            reference = [copy.deepcopy(row) for row in reference for _ in range(arg)]
        elif op == "select" and any(arg[:batch]):
            index = [i for i in range(batch) if arg[i]]
            cache.batch_select_indices(torch.tensor(index))
            reference = [reference[i] for i in index]
        check(cache, reference, method)


def step(cache, reference, count: int, seed: int) -> None:
    """``count`` new tokens for every row through the layer, and through the reference."""
    keys, values, queries = tokens(len(reference), count, seed)
    cache.update(keys, values, 0)
    queries = cache.method.transform_queries(queries, 0)
    take_pending().attend(queries, None, 1.0)
    moved = cache.method.transform_keys(keys, 0)
    for b, row in enumerate(reference):
        row.append(cache.method, moved[b : b + 1], values[b : b + 1], queries[b : b + 1])


def check(cache, reference, method) -> None:
    rows = cache.layers[0].rows
    assert len(rows) == len(reference)
    for row, expected in zip(rows, reference, strict=True):
        assert (row.sink_keys.shape[-2], [*row.lengths], row.res_keys.shape[-2]) == (
            len(expected.sink), [b.held for b in expected.blocks], len(expected.residual))
        got, want = row.history(DTYPE), expected.history(method)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()
    layer = cache.layers[0]  # a page is counted once per holder and free once nobody holds it
    holders = Counter(page for pages in layer.store.pages for page in pages)
    assert all(layer.pool.refs[page] == count for page, count in holders.items())
    assert sorted(layer.pool.free) == [p for p in range(layer.pool.capacity) if p not in holders]


def test_the_reference_knows_the_layout():
    """The reference itself agrees with the closed-form layout (45 tokens: 4 | 4 blocks | 9)."""
    cache = make("kivi2")
    row = ReferenceRow()
    keys, values, queries = tokens(1, 45, seed=0)
    row.append(cache.method, keys, values, queries)
    assert (len(row.sink), len(row.blocks), len(row.residual)) == expected_layout(45) == (
        SINK, 4, 9)
