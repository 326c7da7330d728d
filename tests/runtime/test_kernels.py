"""The fused CPU decode op against the torch reference path, on every method it serves: random
caches with GQA, several sequences, padding, crops, reordered beams, chunked decode and edge
lengths of sink and residual; plus how backends are chosen and refused."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import FAST, HQ, D, H, compare_rows, make, method_string
from torch.overrides import TorchFunctionMode

import kvmix
from kvmix.core.importance import selected_channels
from kvmix.core.quantizers import fused_encoding
from kvmix.core.tree import map_tensors, tagged_tensors
from kvmix.methods import Blocks, method_classes, parse_method
from kvmix.runtime.kernels import Unserved, choose, cpu, resolve

SCALE = D**-0.5


@pytest.fixture(scope="module", autouse=True)
def built():
    cpu.load()  # builds on first use: a broken build fails here, loudly


@pytest.mark.parametrize("name", FAST)
def test_the_op_matches_the_reference_through_a_generation(name):
    cache = make(name)
    compare_rows(cache, 45, seed=0, batch=3)
    for step, count in enumerate([1, 1, 5, 1, 16, 1, 1, 8, 1]):  # single and chunked decode
        compare_rows(cache, count, seed=step + 1, batch=3)
    cache.crop(-13)  # the crop ends inside a block: partial blocks
    compare_rows(cache, 1, seed=40, batch=3)
    cache.reorder_cache(torch.tensor([2, 0, 0]))  # beams: copied rows
    compare_rows(cache, 2, seed=41, batch=3)
    assert len(cache.layers[0].rows[0].lengths) >= 3


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "wush", "full", "chanmix"])
@pytest.mark.parametrize("sink, prompt", [(0, 17), (1, 25), (8, 8), (8, 9), (4, 4 + 16 + 8)])
def test_edge_lengths_of_sink_and_residual(name, sink, prompt):
    """Empty sink, a one-token sink, a prompt that is all sink, a residual of exactly one
    group after the first flush, and one new token on top of each."""
    cache = make(name, sink=sink)
    compare_rows(cache, prompt, seed=3, batch=2)
    for step in range(3):
        compare_rows(cache, 1, seed=10 + step, batch=2)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "kxvy:key_bits=3,value_bits=3"])
def test_left_padded_rows_read_only_their_own_tokens(name):
    cache = make(name)
    lengths = torch.tensor([50, 31])
    total = 50
    mask = (torch.arange(total)[None] >= total - lengths[:, None])[:, None, None, :]
    compare_rows(cache, total, seed=5, batch=2, mask=mask)
    for step in range(4):
        grown = torch.cat([mask, torch.ones(2, 1, 1, step + 1, dtype=torch.bool)], -1)
        compare_rows(cache, 1, seed=20 + step, batch=2, mask=grown[..., :, :])


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 8])
def test_every_width_of_kxvy(bits):
    cache = make(f"kxvy:key_bits={bits},value_bits={ {1: 8, 2: 4, 3: 3, 4: 2, 8: 1}[bits]}")
    compare_rows(cache, 60, seed=bits, batch=1)
    compare_rows(cache, 1, seed=100 + bits, batch=1)  # within the op's tolerance


def test_methods_say_which_have_a_fast_path(capsys):
    from kvmix.cli import main

    main(["methods"])
    out = capsys.readouterr().out
    assert "fast path" in out and "reference only" in out
    classes = method_classes()
    assert classes["polar"].fast_path.startswith("reference only")
    assert all(classes[m].fast_path.startswith("cpu op") for m in ("kivi", "pnmix", "wush"))


def test_backends_are_resolved_and_refused_clearly(monkeypatch):
    assert resolve("torch", "cpu") == "torch" and resolve("cpu", "cpu") == "cpu"
    assert resolve("auto", "cpu") == "cpu"
    with pytest.raises(ValueError, match="backend='gpu' is invalid; valid: auto, torch, cpu"):
        resolve("gpu", "cpu")
    with pytest.raises(ValueError, match="backend='cpu' runs on CPU tensors; the model is on meta"):
        resolve("cpu", "meta")
    assert resolve("auto", "meta") == "torch"
    monkeypatch.setattr(cpu, "available", lambda: (False, "g++ failed: boom"))
    with pytest.raises(ValueError, match="backend='cpu' is unavailable: g\\+\\+ failed: boom"):
        resolve("cpu", "cpu")
    with pytest.warns(UserWarning, match="unavailable, using the reference path: g\\+\\+ fail"):
        assert resolve("auto", "cpu") == "torch"


@pytest.mark.parametrize("text, reason", [
    ("kxvy:backend=quanto", "backend=quanto"), ("kxvy:backend=hqq", "backend=hqq"),
    ("pnmix:criterion=qk_pair_norm,selection=online", "selection=online"), ("polar", "polar")])
def test_a_method_instance_without_a_fused_path_is_decoded_by_reference(text, reason):
    """The paged kernels' choice (kvmix's vLLM plugin) reads the method instance: a setting
    that turns its fused decode off gets the reference path with that reason under ``auto``,
    and a refusal naming it when the kernels are asked for by name."""
    method = parse_method(text)
    choice, why = choose("auto", method, D, torch.float32, torch.device("cpu"))
    assert choice == "torch" and reason in why
    with pytest.raises(Unserved, match=f"kernels='cpu' cannot be honoured: .*{reason}"):
        choose("cpu", method, D, torch.float32, torch.device("cpu"))
    assert choose("auto", parse_method("kxvy"), D, torch.float32, torch.device("cpu")) == \
        ("cpu", "")


@pytest.mark.parametrize("layout, named", [("group=4,residual=16", "group=4"),
                                           ("value_group=4", "value_group=4")])
def test_groups_the_op_does_not_tile_are_refused_when_the_cache_is_made(layout, named):
    """An explicit backend='cpu' is an error naming the size; auto takes the reference path with
    one warning; either way before any decode step (the op itself would fail mid-decode)."""
    from conftest import tiny_llama

    model, method = tiny_llama(seed=2), f"kivi2:{layout}"
    with pytest.raises(ValueError, match=f"backend='cpu' cannot read kivi's blocks: {named} is "
                                         "not a multiple of 8, which the CPU decode op tiles"):
        kvmix.make_cache(model, method, backend="cpu")
    with pytest.warns(UserWarning, match=f"{named} is not a multiple of 8.*using the reference"):
        cache = kvmix.make_cache(model, method, backend="auto")
    assert cache.backend == "torch"
    ids = torch.randint(1, 97, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # decodes through the reference path
        out = model.generate(ids, cache=cache, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 43)
    assert kvmix.make_cache(model, "kivi2", backend="auto").backend == "cpu"  # 32 and 32: tiled


def test_a_compiler_failure_names_the_compiler_and_its_message(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises(cpu.KernelUnavailable, match="no C\\+\\+ compiler"):
        cpu._build(tmp_path / "op.so")
    fake = tmp_path / "cxx"
    fake.write_text("#!/bin/sh\necho 'error: it broke' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    with pytest.raises(cpu.KernelUnavailable,
                       match=r"failed to build decode\.cpp:\nerror: it broke"):
        cpu._build(tmp_path / "op.so")


def test_tensors_off_the_cpu_are_refused_by_the_cpu_backend(tiny_model):
    cache = kvmix.KVMixCache("kivi2", tiny_model.config, backend="cpu")
    with pytest.raises(ValueError, match="backend='cpu' runs on CPU tensors; layer 0's keys are "
                                         "on meta"):
        cache.update(torch.empty(1, 2, 3, 32, device="meta"),
                     torch.empty(1, 2, 3, 32, device="meta"), 0)
    with pytest.raises(ValueError, match="backend='auto' is invalid here; valid: torch, cpu"):
        kvmix.KVMixCache("kivi2", tiny_model.config, backend="auto")


def test_generation_is_the_same_with_both_backends(tiny_model):
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(9))
    outputs = {}
    for backend in ("torch", "cpu"):
        cache = kvmix.make_cache(tiny_model, method_string("pnmix1"), backend=backend)
        assert cache.backend == backend
        with torch.no_grad():
            outputs[backend] = tiny_model.generate(ids, attention_mask=torch.ones_like(ids),
                                                   cache=cache, max_new_tokens=60,
                                                   min_new_tokens=60, do_sample=False)
    assert torch.equal(outputs["torch"], outputs["cpu"])


def test_the_op_checks_its_inputs():
    query = torch.randn(HQ, 1, D)
    keys = torch.randn(1, 2, 5, D)
    with pytest.raises(RuntimeError, match="float segments must be"):
        torch.ops.kvmix.decode(query, 1.0, [keys], [keys[:, :, :4]], 1, 8, [], None, None, None)
    with pytest.raises(RuntimeError, match="the causal segment must hold exactly the new tokens"):
        torch.ops.kvmix.decode(query, 1.0, [keys], [keys], 1, 8, [], None, None, None)


@dataclasses.dataclass
class OpCall:
    """A call of ``kvmix::decode``, by name: the float segments and the packed layouts
    (``cpu.Planes``, ``cpu.Groups``)."""

    query: torch.Tensor
    scale: float
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    causal: int
    group: int
    lengths: list[int]
    planes: cpu.Planes | None
    token_keys: cpu.Groups | None
    groups: cpu.Groups | None

    def run(self) -> torch.Tensor:
        return torch.ops.kvmix.decode(self.query, self.scale, self.keys, self.values,
                                      self.causal, self.group, self.lengths,
                                      *cpu.op_layouts([self.planes, self.token_keys,
                                                       self.groups]))


def op_call(name: str) -> OpCall:
    """A valid call for one sequence of ``name`` holding sealed blocks."""
    from helpers import feed, tokens

    cache = make(name, backend="cpu")
    feed(cache, 40, batch=1)
    row = cache.layers[0].rows[0]
    view = cache.method.kernel_view(row.blocks, 0, row.selection)
    keys, values, queries = (t.float() for t in tokens(1, 1, 9))
    floats = [(row.sink_keys, row.sink_values), (row.res_keys, row.res_values), (keys, values)]
    return OpCall(queries[0].contiguous(), D**-0.5, [k.float().contiguous() for k, _ in floats],
                  [v.float().contiguous() for _, v in floats], 1, cache.method.group,
                  row.lengths, *cpu.packed_layouts(view))


def bad_calls(valid: OpCall) -> dict[str, tuple[OpCall, str]]:
    """Each kind of bad argument: (the call with it, what the error must name)."""
    planes, groups = valid.planes, valid.groups
    index = planes.index[0].clone()
    index.view(-1)[0] = D  # a channel past the head
    changed = functools.partial(dataclasses.replace, valid)
    return {
        "no KV heads": (changed(keys=[x[:, :0] for x in valid.keys]), "KV heads"),
        "plane lists of unequal length": (changed(planes=dataclasses.replace(
            planes, bits=planes.bits[:-1])), "lists of equal length"),
        "plane channel outside the head": (changed(planes=dataclasses.replace(
            planes, index=[index, *planes.index[1:]])), "outside \\[0, D\\)"),
        "value codes cut short": (changed(groups=dataclasses.replace(
            groups, codes=groups.codes[:, :-1].contiguous())), "value codes hold"),
        "a block longer than a group": (changed(lengths=[99] * len(valid.lengths)),
                                        "0 to group tokens"),
        "more lengths than blocks": (changed(lengths=valid.lengths * 2),
                                     "more lengths than packed blocks"),
        "zero token group": (changed(group=0), "positive multiple of 8 tokens"),
        "zero value group": (changed(groups=dataclasses.replace(groups, group=0)),
                             "positive multiple of 8 channels"),
        "value scales of another shape": (changed(groups=dataclasses.replace(
            groups, scale=groups.scale[:-1].contiguous())), "scale and min must hold"),
        "key offset of another shape": (changed(planes=dataclasses.replace(
            planes, offset=planes.offset[:, :-1].contiguous())), "key offset must be"),
        "query of another rank": (changed(query=valid.query[0]), "query must be"),
    }


def test_the_op_refuses_every_kind_of_bad_argument_with_a_message_naming_it(built):
    """Shapes of packed tensors, list lengths, held lengths, channel indices, zero sizes: an
    error naming the argument, never a crash or a wrong result."""
    valid = op_call("kivi2")
    assert valid.lengths and valid.planes.codes  # blocks and channel planes are read
    assert valid.run().isfinite().all()
    for case, (call, message) in bad_calls(valid).items():
        with pytest.raises(RuntimeError, match=message):
            call.run()
            pytest.fail(f"accepted: {case}")


def test_the_batched_op_refuses_a_table_outside_the_pool(built):
    from helpers import feed

    from kvmix.runtime.kernels import batch

    cache = make("kivi2", backend="cpu")
    feed(cache, 40, batch=2)
    store = cache.layers[0].store
    table, query = store.steps.table(store), torch.randn(2, HQ, D)
    pool = cpu._pool_arguments(batch.pool_view(store))
    slots = [store.keys.float().contiguous(), store.values.float().contiguous()]
    head = [query, D**-0.5, *slots, torch.tensor(store.float_spans()), cache.method.group]
    assert torch.ops.kvmix.decode_batch(*head, table.pages, table.held, table.counts,
                                        *pool).isfinite().all()
    for pages, held, counts, message in [
            (table.pages + 10**6, table.held, table.counts, "names a page outside the pool"),
            (table.pages, -table.held, table.counts, "or more tokens than a group"),
            (table.pages, table.held, table.counts + 99, "counts must be within")]:
        with pytest.raises(RuntimeError, match=message):
            torch.ops.kvmix.decode_batch(*head, pages, held, counts, *pool)
    for skip, message in [(torch.tensor([1]), r"skip must be \[S\]"),
                          (torch.tensor([-1, 0]), "skip must lie in the sequence's first page"),
                          (torch.tensor([0, 99]), "skip must lie in the sequence's first page")]:
        with pytest.raises(RuntimeError, match=message):
            torch.ops.kvmix.decode_batch(*head, table.pages, table.held, table.counts, *pool,
                                         skip=skip)


def test_the_batched_op_reads_rows_apart_and_writes_into_out(built):
    """A query whose rows lie apart (a view of a fused qkv, as vLLM's) gives the contiguous
    query's output, exactly, and ``out=`` receives it in place; an ``out`` of the wrong size or
    dtype, and a query whose heads are not contiguous, are refused by name."""
    from helpers import feed

    from kvmix.runtime.kernels import batch

    cache = make("kivi2", backend="cpu")
    feed(cache, 40, batch=2)
    store = cache.layers[0].store
    table = store.steps.table(store)
    fused = torch.randn(2, HQ + 2 * H, D)  # [S, Hq + 2H, D]: rows (Hq + 2H)·D apart
    query = fused[:, :HQ]
    pool = cpu._pool_arguments(batch.pool_view(store))
    slots = [store.keys.float().contiguous(), store.values.float().contiguous()]
    args = [D**-0.5, *slots, torch.tensor(store.float_spans()), cache.method.group,
            table.pages, table.held, table.counts, *pool]
    expected = torch.ops.kvmix.decode_batch(query.contiguous(), *args)
    assert torch.equal(torch.ops.kvmix.decode_batch(query, *args), expected)
    out = torch.full((2, HQ, D), float("nan"))
    assert torch.ops.kvmix.decode_batch(query, *args, out=out).numel() == 0
    assert torch.equal(out, expected)
    for bad in (torch.empty(2, HQ, D - 1), torch.empty(2, HQ, D, dtype=torch.float64)):
        with pytest.raises(RuntimeError, match="out must be contiguous float32"):
            torch.ops.kvmix.decode_batch(query, *args, out=bad)
    with pytest.raises(RuntimeError, match="each row's heads contiguous"):
        torch.ops.kvmix.decode_batch(query.transpose(0, 1).contiguous().transpose(0, 1), *args)


def test_the_op_is_dispatched_without_torch_function_handling(built):
    """``cpu.call`` runs the op with ``__torch_function__`` handling off (its probe of each
    TorchScript argument raises and catches a C++ exception): a mode that sees every call
    torch hands to Python sees the plain call, not ``cpu.call``'s, and both give one result."""
    from helpers import feed, step

    from kvmix.runtime.kernels import batch

    class Seen(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.calls: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    cache = make("kivi2", backend="cpu")
    feed(cache, 40, batch=2)
    store = cache.layers[0].store
    table, query = store.steps.table(store), torch.randn(2, HQ, D)
    slots = [store.keys.float().contiguous(), store.values.float().contiguous()]
    args = [query, D**-0.5, *slots, torch.tensor(store.float_spans()), cache.method.group,
            table.pages, table.held, table.counts, *cpu._pool_arguments(batch.pool_view(store))]
    with Seen() as plain:
        expected = torch.ops.kvmix.decode_batch(*args)
    with Seen() as called:
        out = cpu.call("decode_batch", *args)
    assert any("decode_batch" in name for name in plain.calls)
    assert not any("decode_batch" in name for name in called.calls)
    assert torch.equal(out, expected)
    # kvmix's own calls go through cpu.call: a batched decode step, one sealing pages (its
    # encoder), and a row's attention
    with Seen() as runtime:
        for i in range(8):
            step(cache, 2, i)
        row = store.row(0)
        view = cache.method.kernel_view(row.blocks, 0, row.selection)
        keys, values = torch.randn(2, 1, H, 1, D).unbind(0)
        cpu.attend(row, view, query[:1, :, None], keys, values, D**-0.5)
    assert runtime.calls and not any("kvmix" in name for name in runtime.calls)


PORTABLE = """
import sys
sys.path.insert(0, {tests!r})
from helpers import compare_rows, make
from kvmix.runtime.kernels import cpu
assert not cpu.integer(), cpu.describe()
print(cpu.describe())
for name in ("kivi2", "pnmix1", "kxvy:key_bits=3,value_bits=3,value_group=16", "wush"):
    cache = make(name, group=16)
    compare_rows(cache, 70, seed=1, batch=2, tolerance=1e-5)
    for step in range(3):
        compare_rows(cache, 1, seed=2 + step, batch=2, tolerance=1e-5)
"""


@pytest.mark.process
def test_the_portable_float_kernels_match_the_reference():
    """A build without VNNI (what CPUs lacking it get) runs the float kernels, says why, and
    matches the reference path to float32 rounding, keys and values, groups of 16. The build
    is cached like any other (the flags are in its key): a machine pays for it once."""
    env = {**os.environ, "KVMIX_CXXFLAGS": "-mno-avx512vnni"}
    script = PORTABLE.format(tests=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("float kernels (portable"), result.stdout


def test_float16_segments_are_read_as_their_float32_widening():
    """A 32-bit model's float16 slots go to the op as they are: the result is the op's on the
    same values widened to float32, exactly; keys and values of different dtypes are refused."""
    valid = op_call("kivi2")
    half = dataclasses.replace(valid, keys=[k.half() for k in valid.keys],
                               values=[v.half() for v in valid.values])
    widened = dataclasses.replace(valid, keys=[k.float() for k in half.keys],
                                  values=[v.float() for v in half.values])
    assert torch.equal(half.run(), widened.run())
    mixed = dataclasses.replace(valid, keys=half.keys)
    with pytest.raises(RuntimeError, match="equal shape and dtype"):
        mixed.run()


TIMED = """
import json, sys
sys.path.insert(0, {tests!r})
from helpers import compare_rows, make
from kvmix.runtime.kernels import cpu
cache = make("kivi2", group=16)
compare_rows(cache, 70, seed=1, batch=3)
cpu.timings()
compare_rows(cache, 1, seed=2, batch=3)
print(json.dumps(cpu.timings()))
"""


@pytest.mark.process
def test_the_op_times_its_parts_only_when_asked():
    """KVMIX_OP_TIMING=1 before the op loads: a decode step's calls, each part's time (the
    threads' parts within the threads' share of the calls' wall time); without it, zeros."""
    env = {**os.environ, "KVMIX_OP_TIMING": "1"}
    script = TIMED.format(tests=str(Path(__file__).parents[1]))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    spent = json.loads(result.stdout.splitlines()[-1])
    assert spent["calls"] >= 1 and spent["wall"] > 0, spent
    assert all(value >= 0 for value in spent.values()), spent
    threaded = sum(spent[part] for part in ("start", "keys_float", "keys_packed", "softmax",
                                            "values_float", "values_packed", "merge"))
    assert 0 < threaded <= 1.1 * torch.get_num_threads() * spent["wall"], spent
    assert spent["setup"] + spent["stage"] <= spent["wall"], spent
    if os.environ.get("KVMIX_OP_TIMING", "0") in ("", "0"):  # here: not asked
        compare_rows(make("kivi2", group=16), 20, seed=1, batch=3)
        assert set(cpu.timings().values()) == {0.0}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name, layout", [("kivi2", {}),
                                          ("kxvy:key_bits=3,value_bits=4", {"value_group": 8}),
                                          ("pnmix1", {}), ("pnmix1", {"group": 32, "residual": 32}),
                                          ("pnmix:high_bits=4,low_bits=2", {})])
def test_groups_encoded_into_pages_are_what_encode_stores(built, name, layout, dtype):
    """kvmix::encode_pages: sealed groups read where seal_tokens leaves them (a token-major
    buffer seen [2, E, H, G, D]) and written into pages out of order, keys and values or keys
    only, bit for bit the method's encode (statistics as values: +0 or -0), constant groups
    and values near zero among them; every other page left as it was."""
    method = make(name, **layout).method
    encoding = method.page_encoding(0)
    E, G, P, pages = 3, method.group, 6, torch.tensor([4, 0, 2])
    assert layout.get("group", G) == G and encoding.value_group == layout.get("value_group", 32)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randn(2, E * G, H, D, generator=g) * 3
    tokens[1, 0] = 1.5  # a token's constant value groups
    tokens[0, :, 0, :4] = torch.linspace(-3e-8, 2e-8, E * G)[:, None]  # channels near zero
    tokens = tokens.to(dtype)
    seen = tokens.view(2, E, G, H, D).permute(0, 1, 3, 2, 4)  # [2, E, H, G, D], strided
    # as seal_tokens leaves them (channels side by side), and channels apart (the scalar path)
    for groups in (seen, seen.transpose(-1, -2).contiguous().transpose(-1, -2)):
        encoded_into_pages(method, encoding, groups, pages, P, g)


def encoded_into_pages(method, encoding, groups, pages, P, g) -> None:
    _, E, _, G, _ = groups.shape  # [2, E, H, G, D]
    selection, channels = None, encoding.channels
    if channels is not None:
        queries = torch.randn(E, HQ, G, D, generator=g).to(groups.dtype)
        selection = method.select(queries, groups[0], 0, groups[1])
    with fused_encoding(None):  # torch's encoder: the reference
        expected = Blocks(*method.encode(groups[0], groups[1], 0, selection))
    for keys_only in (False, True):
        stored = map_tensors(expected, lambda t: torch.zeros(P, *t.shape[1:], dtype=t.dtype))
        index = None if channels is None else selected_channels(
            selection.bits, H, channels.units, channels.pairs, channels.count)
        assert index is None or torch.equal(index, method.high_index(selection))
        values = [] if keys_only else [stored.values.codes, stored.values.scale,
                                       stored.values.minimum]
        cpu.call("encode_pages", [getattr(stored.keys, f) for f in encoding.key_fields], values,
                 groups[:1] if keys_only else groups, pages, index, encoding.low_bits,
                 encoding.high_bits, encoding.center, encoding.value_bits, encoding.value_group)
        for part in ("keys", "values"):
            written = tagged_tensors(map_tensors(getattr(stored, part), lambda t: t[pages]), "")
            for (path, got), (_, want) in zip(written, tagged_tensors(
                    getattr(expected, part), ""), strict=True):
                unwritten = keys_only and part == "values"
                assert torch.equal(got, torch.zeros_like(want) if unwritten else want), \
                    (part, path, keys_only)
        rest = tagged_tensors(map_tensors(stored, lambda t: t[[1, 3, 5]]), "")
        assert all(not t.any() for _, t in rest)


def test_encode_pages_refuses_fields_that_do_not_hold_a_page(built):
    method = make("kivi2").method
    encoding = method.page_encoding(0)
    G = method.group
    groups = torch.randn(2, 1, H, G, D)
    with fused_encoding(None):
        state = Blocks(*method.encode(groups[0], groups[1], 0, None))
    stored = map_tensors(state, lambda t: torch.zeros(2, *t.shape[1:], dtype=t.dtype))
    keys = [stored.keys.codes, stored.keys.scale.float(), stored.keys.minimum]  # not float16
    with pytest.raises(RuntimeError, match="key fields must hold a page's codes"):
        cpu.call("encode_pages", keys, [], groups[:1], torch.tensor([0]), None,
                 encoding.low_bits, encoding.high_bits, False, 2, 32)
    assert not stored.keys.codes.any()  # refused before any write
    fields = [stored.keys.codes, stored.keys.scale, stored.keys.minimum]
    with pytest.raises(RuntimeError, match="pages name a page outside"):
        cpu.call("encode_pages", fields, [], groups[:1], torch.tensor([2]), None, 2, 2, False,
                 2, 32)
    twice = groups.expand(2, 2, *groups.shape[2:])  # two groups for one page
    with pytest.raises(RuntimeError, match="pages must be distinct"):
        cpu.call("encode_pages", fields, [], twice[:1], torch.tensor([1, 1]), None, 2, 2,
                 False, 2, 32)


def test_step_rows_refuse_arrays_that_do_not_describe_one_step(built):
    """kvmix::step's rows (built once a step, read by every layer) check their shapes when
    built: a block table, floats and counts of one row count, int64; seals all or none."""
    K, M, N = 3, 2, 4
    table, counts = torch.zeros(K, M, dtype=torch.long), torch.zeros(K, dtype=torch.long)
    floats, stage_at = torch.zeros(K, 4, dtype=torch.long), torch.full((N,), -1)
    seals = [torch.zeros(1, dtype=torch.long)] * 6
    rows = torch.classes.kvmix.StepRows(table, table, counts, floats, stage_at, None, *seals, 8)
    assert rows is not None
    with pytest.raises(RuntimeError, match=r"table, held \[K, M\], counts \[K\]"):
        torch.classes.kvmix.StepRows(table, table, counts[:2], floats, stage_at, None,
                                     *seals, 8)
    with pytest.raises(RuntimeError, match="int64"):
        torch.classes.kvmix.StepRows(table.int(), table, counts, floats, stage_at, None,
                                     *seals, 8)
    with pytest.raises(RuntimeError, match="seals come with their pages"):
        torch.classes.kvmix.StepRows(table, table, counts, floats, stage_at, None,
                                     *seals[:5], None, 8)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_op_lays_new_tokens_out_rounded_as_torch_rounds_them(built, dtype):
    """New keys and values [N, H, D] (a strided float32 view, as vLLM hands them) staged by the
    op hold exactly torch's own rounding of them to the staging dtype, and the row reads them."""
    N, T = 5, 16
    fused = torch.randn(N, 3 * H, D) * 1000  # values float16 and bfloat16 must round
    keys, values = fused[:, :H], fused[:, H : 2 * H]
    slots = [torch.zeros(1, H, T, D, dtype=dtype) for _ in range(2)]
    spans = torch.tensor([[0, 0, 0, N]])  # nothing staged; the row's N new tokens
    empty = torch.zeros(1, 1, dtype=torch.long)
    query = torch.randn(1, HQ, D)
    out = torch.ops.kvmix.decode_batch(
        query, D**-0.5, *slots, spans, 16, empty, empty,
        torch.zeros(1, dtype=torch.long), None, None, None, None, None,
        new_keys=keys, new_values=values, stage_at=torch.arange(N) + 3)
    laid = [x.transpose(0, 1).unsqueeze(0).to(dtype).contiguous() for x in (keys, values)]
    given = torch.ops.kvmix.decode_batch(
        query, D**-0.5, *(torch.zeros_like(s) for s in slots), spans, 16, empty, empty,
        torch.zeros(1, dtype=torch.long), None, None, None, None, None,
        step_keys=laid[0], step_values=laid[1])
    assert torch.equal(out, given)  # the row read the tokens it staged
    for slot, x in zip(slots, (keys, values), strict=True):
        assert torch.equal(slot[0, :, 3 : 3 + N], x.transpose(0, 1).to(dtype))
        assert not slot[0, :, :3].any() and not slot[0, :, 3 + N :].any()


@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [(9, 3), (8, 2)])
def test_half_float_tokens_are_read_as_their_float32_widening(built, dim, dtype, heads):
    """Float tokens in float16 or bfloat16 at the head dims the SIMD float kernels serve (64,
    128), widened as they are read: exactly the op's result on the same values in float32, for
    a query group of 3 (one tile of three rows) and of 4."""
    hq, h = heads
    keys, values = (torch.randn(1, h, 37, dim).to(dtype) for _ in range(2))
    query = torch.randn(hq, 1, dim)

    def attend(k, v):
        return torch.ops.kvmix.decode(query, dim**-0.5, [k], [v], 0, 16, [], None, None, None)

    assert torch.equal(attend(keys, values), attend(keys.float(), values.float()))
