"""A continuous-batching step is staged in a layer, then committed or rolled back: a rollback
leaves the layer exactly as it was before the step (lengths, block table, pool, slots), and the
step retried gives bit for bit what it gives without the rollback. A refused prompt or step
(non-finite, beyond float16) changes nothing and names its rows."""

from __future__ import annotations

import pytest
import torch
from helpers import SINK, D, make, tokens

from kvmix.runtime.store import RowFault

SCALE = D**-0.5


def layer_of(name: str, backend: str, window: int | None = None):
    return make(name, backend=backend, window=window, max_batch=6, max_tokens=160).layers[0]


def prompt(length: int, seed: int):
    """One prompt as a join takes it: (queries, keys, values) [1, *, n, D]."""
    keys, values, queries = tokens(1, length, seed, dtype=torch.float32)
    return queries, keys, values


def decode(layer, seed: int) -> torch.Tensor:
    keys, values, queries = tokens(layer.store.batch, 1, seed, dtype=torch.float32)
    return layer.decode(queries, keys, values, SCALE)


def snapshot(layer) -> tuple:
    """Everything a step can change: per row its lengths, pages and held slots; the pool."""
    store, rows = layer.store, []
    for b in range(store.batch):
        residual = slice(SINK, SINK + store.res_len[b])
        rows.append((store.sink_len[b], store.res_len[b], list(store.pages[b]),
                     list(store.held[b]), store.dropped[b],
                     *(x[:, : store.sink_len[b]].clone() for x in store.slots(b)),
                     *(x[:, residual].clone() for x in store.slots(b))))
    return rows, list(layer.pool.refs), sorted(layer.pool.free), list(layer.pads)


def same(a: tuple, b: tuple) -> bool:
    rows_a, *rest_a = a
    rows_b, *rest_b = b
    return rest_a == rest_b and len(rows_a) == len(rows_b) and all(
        all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
            for x, y in zip(ra, rb, strict=True)) for ra, rb in zip(rows_a, rows_b, strict=True))


def run(layer, roll_back_at: int | None) -> list[torch.Tensor]:
    """Three prompts, then 14 decode steps (a fourth prompt joins at step 7): each step
    committed; at ``roll_back_at`` the step is first staged, with a join, and rolled back.
    Residuals fill (the commit seals) at steps 2, 3, 10 and 11."""
    layer.join([prompt(n, 10 + i) for i, n in enumerate((40, 25, 9))], SCALE)
    layer.commit()
    outs, sealed = [], [sealed_tokens(layer)]
    for i in range(14):
        if i == roll_back_at:
            before = snapshot(layer)
            decode(layer, 100 + i)
            layer.join([prompt(30, 99)], SCALE)
            layer.rollback()
            assert same(snapshot(layer), before)
        outs.append(decode(layer, 100 + i))
        if i == 7:
            outs += layer.join([prompt(21, 7)], SCALE)
        layer.commit()
        sealed.append(sealed_tokens(layer))
    assert all(sealed[i + 1] > sealed[i] for i in (2, 3, 10, 11))
    return outs


def sealed_tokens(layer) -> int:
    """Tokens that left the residuals into pages (held, or released behind a window)."""
    store = layer.store
    return sum(sum(store.held[b]) + store.dropped[b] for b in range(store.batch))


@pytest.mark.parametrize(("name", "backend", "window"), [
    ("kivi2", "cpu", None), ("pnmix1", "cpu", None), ("kivi2", "torch", None),
    ("pnmix1", "cpu", 24)])
def test_a_rolled_back_step_leaves_the_layer_as_it_was_and_retries_identically(
        name, backend, window):
    """The rolled-back step would seal pages when committed (steps 3 and 10: full
    residuals), joins a row, and, with a window, would release pages: all undone; the retried
    step's output and every later one equal the run without a rollback."""
    plain = run(layer_of(name, backend, window), None)
    for at in (3, 7, 10):
        rolled = run(layer_of(name, backend, window), at)
        assert all(torch.equal(a, b) for a, b in zip(plain, rolled, strict=True))


def test_steps_are_sealed_only_when_committed():
    layer = layer_of("kivi2", "cpu")
    layer.join([prompt(15, 1)], SCALE)  # a residual of 11 (sink 4)
    layer.commit()
    for i in range(4):
        decode(layer, i)
        layer.commit()
    assert layer.store.res_len == [15] and layer.pool.used == 0
    decode(layer, 9)  # the residual fills: this step's commit seals its oldest group
    assert layer.store.res_len == [16] and layer.pool.used == 0
    layer.commit()
    assert layer.pool.used == 1 and layer.store.res_len == [8]


def test_a_refused_prompt_names_its_row_and_changes_nothing():
    layer = layer_of("kivi2", "cpu")
    layer.join([prompt(20, 1), prompt(12, 2)], SCALE)
    layer.commit()
    before = snapshot(layer)
    bad = prompt(30, 3)
    bad[1][0, 1, 17, 3] = float("nan")
    with pytest.raises(RowFault, match="non-finite keys in layer 0") as fault:
        layer.join([prompt(9, 4), bad], SCALE)
    assert fault.value.rows == [3]  # the second prompt joining after rows 0 and 1
    layer.rollback()
    assert same(snapshot(layer), before)
    huge = prompt(40, 5)
    huge[2][0, 0, 10, 0] = 1e6  # a value beyond float16 in the first sealed group
    with pytest.raises(RowFault, match="beyond the float16 range") as fault:
        layer.join([huge], SCALE)
    assert fault.value.rows == [2]
    layer.rollback()
    assert same(snapshot(layer), before)


def test_a_decode_step_flags_each_row_it_cannot_keep():
    """peaks: each row's largest magnitude, NaN where a value is NaN (the step's validation
    reads it once, with the logits)."""
    layer = layer_of("kivi2", "cpu")
    layer.join([prompt(20, 1), prompt(12, 2), prompt(8, 3)], SCALE)
    layer.commit()
    keys, values, queries = tokens(3, 1, 7, dtype=torch.float32)
    keys[1, 0, 0, 5] = float("nan")
    values[2, 1, 0, 0] = 7e4
    layer.decode(queries, keys, values, SCALE)
    peaks = layer.peaks
    assert peaks[0] < 100 and torch.isnan(peaks[1]) and peaks[2] == pytest.approx(7e4)
    layer.rollback()
