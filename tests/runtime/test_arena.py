"""Float slots in one arena per layer, each row an extent of the slots it may fill: rows of any
extent, placed first fit in the gaps that leaving rows free and compacted when no gap fits,
attend exactly as each would alone with a whole sink and residual, in the reference path and
the fused op; a fixed arena never grows, and no row is let past its extent."""

from __future__ import annotations

import pytest
import torch
from helpers import RESIDUAL, SINK, D, make, tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmix.runtime.arena import SlotArena
from kvmix.runtime.store import RowFault

SCALE = D**-0.5
ARENA = 48


def layer_of(backend: str, slots: int | None = None):
    layer = make("kivi2", backend=backend, max_batch=8, max_tokens=160).layers[0]
    layer.max_slots = slots
    return layer


def prompt(length: int, seed: int):
    """One prompt as a join takes it: (queries, keys, values) [1, *, n, D]."""
    keys, values, queries = tokens(1, length, seed, dtype=torch.float32)
    return queries, keys, values


class Driver:
    """Requests by name through one layer: joins, decode steps (each request's token its own,
    whatever its row), leaves; every output kept by request."""

    def __init__(self, layer):
        self.layer, self.order, self.outs, self.steps = layer, [], {}, {}

    def join(self, requests: list[tuple[str, int, int | None]]) -> None:
        """(name, prompt length, extent or None: a whole sink and residual) each."""
        prompts = [prompt(n, hash(name) % 1000) for name, n, _ in requests]
        extents = [e if e is not None else SINK + RESIDUAL for _, _, e in requests]
        outs = self.layer.join(prompts, SCALE, extents)
        self.layer.commit()
        for (name, _, _), out in zip(requests, outs, strict=True):
            self.order.append(name)
            self.outs[name], self.steps[name] = [out], 0

    def decode(self) -> None:
        rows = [tokens(1, 1, 1000 + 50 * ord(name) + self.steps[name], dtype=torch.float32)
                for name in self.order]
        keys, values, queries = (torch.cat(x) for x in zip(*rows, strict=True))
        out = self.layer.decode(queries, keys, values, SCALE)
        self.layer.commit()
        for b, name in enumerate(self.order):
            self.outs[name].append(out[b : b + 1])
            self.steps[name] += 1

    def leave(self, name: str) -> None:
        b = self.order.index(name)
        self.layer.leave(b)
        self.order[b] = self.order[-1]
        self.order.pop()


def extents_apart(arena: SlotArena) -> bool:
    """Every row's extent lies in the arena and no two overlap."""
    spans = sorted(zip(arena.offset, arena.capacity, strict=True))
    ends = [at + size for at, size in spans]
    return all(end <= at for end, (at, _) in zip(ends, spans[1:], strict=False)) and (
        not ends or ends[-1] <= arena.slots)


def shared_run(backend: str) -> dict[str, list[torch.Tensor]]:
    """A fixed arena of 48 slots: a (30 tokens, whole extent 20), b (5 + 3, extent 9) and c
    (8 + 7, extent 16) join; b leaves and d (3 + 4, extent 7) takes its gap; e (3 + 2, extent
    5) fits no gap (2 and 3 slots) and the rows are compacted, filling all 48."""
    layer = layer_of(backend, ARENA)
    run = Driver(layer)
    store = layer.store
    run.join([("a", 30, None), ("b", 5, 9), ("c", 8, 16)])
    for _ in range(3):
        run.decode()
    run.leave("b")
    run.join([("d", 3, 7)])
    assert store.offset[run.order.index("d")] == 20  # b's gap, first fit
    for _ in range(2):
        run.decode()
    run.join([("e", 3, 5)])
    assert sum(store.capacity) == store.slot_capacity == ARENA and extents_apart(store.arena)
    for _ in range(2):
        run.decode()
    return run.outs


def solo_run(backend: str, name: str, length: int, steps: int) -> list[torch.Tensor]:
    """One request alone in a growing arena, with a whole sink and residual."""
    run = Driver(layer_of(backend))
    run.join([(name, length, None)])
    for _ in range(steps):
        run.decode()
    return run.outs[name]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_rows_of_any_extent_attend_as_each_would_alone(backend):
    shared = shared_run(backend)
    for name, length in (("a", 30), ("b", 5), ("c", 8), ("d", 3), ("e", 3)):
        alone = solo_run(backend, name, length, len(shared[name]) - 1)
        for step, (x, y) in enumerate(zip(shared[name], alone, strict=True)):
            assert torch.allclose(x, y, atol=1e-6, rtol=1e-5), (name, step)


def test_a_fixed_arena_refuses_a_row_beyond_it_before_any_change():
    layer = layer_of("cpu", 30)
    run = Driver(layer)
    run.join([("a", 6, 20), ("b", 4, 8)])
    store = layer.store
    with pytest.raises(ValueError, match=r"float slots are full: 28 of 30 slots in use and 3"):
        store.add_rows(1, [3])
    assert store.batch == 2 and store.slot_capacity == 30 and extents_apart(store.arena)


def test_a_row_is_never_let_past_its_extent():
    """A row of 3 + 2 tokens' extent decodes twice; its third token is refused (naming its
    row) before any row changes, and a prompt longer than its extent is refused at join."""
    layer = layer_of("cpu", ARENA)
    run = Driver(layer)
    run.join([("a", 6, None), ("b", 3, 5)])
    run.decode()
    run.decode()
    store = layer.store
    before = (list(store.sink_len), list(store.res_len))
    with pytest.raises(RowFault, match="row 1 has float slots for 5 tokens") as fault:
        run.decode()
    assert fault.value.rows == [1] and (store.sink_len, store.res_len) == before
    with pytest.raises(RowFault, match="has float slots for 4 tokens"):
        layer.join([prompt(9, 3)], SCALE, [4])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_resplit_moves_pages_and_slots_and_every_row_reads_the_same(backend):
    """Rows holding pages; the first leaves, freeing the lowest page ids. One of two twin
    layers then gets a pool of just the pages in use and five more (those beyond move below,
    the block table renumbered) and an arena of just the rows' extents; every later step
    attends exactly as in the untouched twin."""
    twins = [Driver(layer_of(backend)), Driver(layer_of(backend))]
    for run in twins:
        run.join([("a", 60, None), ("b", 33, None), ("c", 26, None)])
        run.decode()
        run.leave("a")
    layer = twins[1].layer
    used, highest = layer.pool.used, max(max(pages) for pages in layer.store.pages)
    moved = layer.pool.resize(used + 5)
    layer.store.renumber(moved)
    layer.store.resize_slots(sum(layer.store.capacity))
    assert highest >= used + 5 and moved and layer.pool.capacity == used + 5
    assert all(page < used + 5 for pages in layer.store.pages for page in pages)
    assert layer.store.slot_capacity == 2 * (SINK + RESIDUAL) and extents_apart(layer.store.arena)
    for run in twins:
        for _ in range(10):
            run.decode()
    for name in ("b", "c"):
        assert all(torch.equal(x, y) for x, y in zip(twins[0].outs[name], twins[1].outs[name],
                                                     strict=True)), name
    with pytest.raises(ValueError, match="below the"):
        layer.pool.resize(layer.pool.used - 1)


# -- the arena alone: any sequence of joins and leaves -------------------------------------------

OPERATIONS = st.lists(st.one_of(st.tuples(st.just("add"), st.lists(st.integers(1, 9), min_size=1,
                                                                     max_size=3)),
                                st.tuples(st.just("remove"), st.integers(0, 50))),
                      max_size=25)


@settings(max_examples=60, deadline=None)
@given(OPERATIONS, st.booleans())
def test_an_arena_keeps_every_rows_slots_through_joins_leaves_and_compaction(operations, fixed):
    """Rows are marked in their slots (keys: the row's name, values: its position in the
    extent) as they join; after every join (first fit, or compacted, or refused when a fixed
    arena is full) and every leave, extents are apart, inside the arena, and each row's slots
    still hold its marks."""
    arena = SlotArena("a test")
    arena.allocate(2, 12, 3, torch.float16, "cpu", fixed=fixed)
    names: list[int] = []
    for step, (kind, what) in enumerate(operations):
        if kind == "remove":
            if names:
                b = what % len(names)
                arena.remove(b)
                names[b] = names[-1]
                names.pop()
        else:
            full = sum(arena.capacity) + sum(what) > arena.slots
            if fixed and full:
                with pytest.raises(ValueError, match="float slots are full"):
                    arena.add(what)
            else:
                first = arena.rows
                arena.add(what)
                for b in range(first, arena.rows):
                    keys, values = arena.views(b)
                    names.append(100 * step + b)
                    keys.fill_(names[-1])
                    values.copy_(torch.arange(arena.capacity[b])[None, :, None].expand_as(values))
        assert arena.rows == len(names)
        assert extents_apart(arena)
        assert arena.nbytes() == arena.slots * arena.token_bytes()  # both storages, whole
        for b, name in enumerate(names):
            keys, values = arena.views(b)
            assert (keys == name).all()
            assert torch.equal(values[0, :, 0], torch.arange(arena.capacity[b],
                                                             dtype=values.dtype))


def test_tokens_by_position_round_trip_through_the_slot_dtype():
    """``put`` rounds to the slot dtype, ``take`` reads the same positions back, and ``move``
    copies slots read before written (overlapping ranges)."""
    arena = SlotArena("a test")
    arena.allocate(2, 10, 4, torch.float16, "cpu")
    arena.add([4, 6])
    at = arena.positions(torch.tensor([1, 1, 0]), torch.tensor([0, 5, 3]))
    assert at.tolist() == [4, 9, 3]
    keys, values = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    arena.put(at, keys, values)
    got = arena.take(at)
    assert torch.equal(got[0], keys.half()) and torch.equal(got[1], values.half())
    before = arena.keys.clone()
    arena.move(torch.tensor([4, 5, 6]), torch.tensor([5, 6, 7]))
    assert torch.equal(arena.keys[0, :, 4:7], before[0, :, 5:8])


def test_an_arena_of_keys_only_holds_and_moves_keys_alone():
    """The vLLM plugin's staging with values="token": keys alone, half the bytes, and every
    row operation works on them."""
    full, keys = SlotArena("full"), SlotArena("keys")
    full.allocate(2, 12, D, torch.float16, "cpu")
    keys.allocate(2, 12, D, torch.float16, "cpu", values=False)
    assert keys.values is None and len(keys.tensors()) == 1
    assert 2 * keys.nbytes() == full.nbytes() and 2 * keys.token_bytes() == full.token_bytes()
    keys.add([4, 4])
    new = torch.randn(3, 2, D)
    keys.put(torch.tensor([0, 1, 5]), new, None)
    (taken,) = keys.take(torch.tensor([5, 0]))
    assert torch.equal(taken, new[[2, 0]].half())
    keys.remove(0)  # row 1 (slots 4..8) becomes row 0
    keys.pick([0], 20)  # and is compacted to slots 0..4 of a bigger arena
    assert keys.slots == 20 and keys.values is None
    assert torch.equal(keys.views(0)[0][:, 1], new[2].half())
    with pytest.raises(ValueError, match="values to put are missing"):
        full.put(torch.tensor([0]), new[:1], None)
