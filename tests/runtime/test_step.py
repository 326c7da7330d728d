"""A decode step without host work (what a captured CUDA graph needs), checked on CPU: no host
sync and no device tensor made from a Python list inside a step (``generate`` and continuous
batching, through the CPU op, the Triton kernels in the interpreter and the reference path);
the step's metadata uploaded once per step for all layers of a kind, from lists compared, never
assumed; and a Triton decode step launching with the same arguments from step to step."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from conftest import tiny_llama
from helpers import method_string, prefill, step, tokens

import kvmix
from kvmix.runtime.kernels import cpu, gpu
from kvmix.runtime.layer import KVMixLayer
from kvmix.runtime.steps import Upload, bucket, meta

BACKENDS = ["cpu"] + (["triton"] if gpu.available()[0] else [])  # the fused paths
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # else Triton's interpreter


class HostWork(AssertionError):
    """A step asked the host for a device value, or made a device tensor from a list."""


class _Guard(threading.local):
    depth = 0


_GUARD = _Guard()


@contextlib.contextmanager
def no_host_work(monkeypatch):
    """Patch what asks the host for a device value or copies synchronously — ``.item()``,
    ``.tolist()``, ``bool()``, ``int()``, ``float()``, ``.cpu()``, ``nonzero``, a boolean mask
    index, a ``.to()`` of pageable host memory to a device — and ``torch.tensor`` /
    ``torch.as_tensor`` with a ``device`` to raise while a guarded call runs (any thread)."""
    def refusing(name, original, condition=lambda *a, **k: True):
        def patched(*args, **kwargs):
            if _GUARD.depth and condition(*args, **kwargs):
                raise HostWork(f"{name} during a decode step")
            return original(*args, **kwargs)
        return patched

    on_device = lambda *a, **k: k.get("device") is not None  # noqa: E731
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, refusing(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "nonzero", refusing("torch.nonzero", torch.nonzero))
    monkeypatch.setattr(torch.Tensor, "__getitem__", refusing(
        "a boolean mask index", torch.Tensor.__getitem__, _masked))
    monkeypatch.setattr(torch.Tensor, "to", refusing(
        "a pageable host-to-device .to()", torch.Tensor.to, _pageable_upload))
    monkeypatch.setattr(torch, "tensor", refusing("torch.tensor(device=)", torch.tensor,
                                                  on_device))
    monkeypatch.setattr(torch, "as_tensor", refusing("torch.as_tensor(device=)",
                                                     torch.as_tensor, on_device))
    yield


def _masked(tensor: torch.Tensor, index) -> bool:
    """Whether an index holds a boolean mask (its result's size is a device value)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool and p.dim() > 0
               for p in parts)


def _pageable_upload(tensor: torch.Tensor, *args, **kwargs) -> bool:
    """Whether ``tensor.to(...)`` copies host memory that is not pinned to another device
    (a synchronous copy)."""
    target = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))),
                                       None))
    return target is not None and torch.device(target).type != "cpu" \
        and tensor.device.type == "cpu" and not tensor.is_pinned()


def guarded(monkeypatch, owner, name: str, entered: list, when=lambda *a: True) -> None:
    """``owner.name`` runs under the guard where ``when(*args)``; ``entered`` counts those
    calls."""
    original = getattr(owner, name)

    def wrapper(*args, **kwargs):
        if not when(*args):
            return original(*args, **kwargs)
        entered.append(name)
        _GUARD.depth += 1
        try:
            return original(*args, **kwargs)
        finally:
            _GUARD.depth -= 1

    monkeypatch.setattr(owner, name, wrapper)


def test_the_guard_refuses_what_it_names(monkeypatch):
    with no_host_work(monkeypatch):
        x = torch.ones(3)
        assert x.sum().item() == 3  # outside a guarded call: allowed
        _GUARD.depth += 1
        try:
            for call in (lambda: x.item(), lambda: x.tolist(), lambda: bool(x[0]),
                         lambda: torch.tensor([1, 2], device="cpu"), lambda: int(x[0]),
                         lambda: float(x[0]), lambda: x.cpu(), lambda: x.nonzero(),
                         lambda: torch.nonzero(x), lambda: x[x > 0],
                         lambda: x[:, None][x > 0, 0], lambda: x.to("meta")):
                with pytest.raises(HostWork):
                    call()
            assert torch.tensor([1, 2]).shape == (2,)  # a host list on the host: allowed
            assert x[1:].shape == (2,) and x.to(torch.float16).dtype == torch.float16
        finally:
            _GUARD.depth -= 1


def stepping(layer, keys, *_) -> bool:
    """Whether ``layer.update(keys, ...)`` is a decode step (one new token, every row
    prefilled)."""
    return layer.is_initialized and keys.shape[-2] == 1 and all(layer.store.prefilled)


# the CPU op on every key layout; Triton's interpreter (slow) on per-channel keys (PN-Mix's
# selection with queries) and per-token keys
GENERATE = [("cpu", name, 30) for name in ("kivi2", "pnmix1", "wush", "full")] + [
    ("triton", name, 8) for name in ("pnmix1", "wush") if "triton" in BACKENDS]


@pytest.mark.parametrize(("backend", "name", "new"), GENERATE)
def test_generate_decodes_without_host_work(backend, name, new, monkeypatch):
    """Every decode step's update and write-and-attend in every layer, over steps that seal
    pages (a seal, after the attention, is host work between steps: between graph replays):
    no sync, no device tensor from a list; the tokens equal the reference path's."""
    device = TRITON_DEVICE if backend == "triton" else "cpu"
    model = tiny_llama(seed=3).to(device)
    method = method_string(name, model if name == "wush" else None)
    prompt = torch.randint(1, 97, (2, 21), generator=torch.Generator().manual_seed(3))
    prompt = prompt.to(device)
    runner = kvmix.prepare_model(model, method)
    out, entered = {}, []
    for run in ("torch", backend):
        cache = kvmix.make_cache(runner, method, backend=run)
        assert cache.backend == run
        with contextlib.ExitStack() as stack:
            if run == backend:
                stack.enter_context(no_host_work(monkeypatch))
                guarded(monkeypatch, KVMixLayer, "update", entered, stepping)
                guarded(monkeypatch, KVMixLayer, "_write_and_attend", entered)
            with torch.no_grad():
                out[run] = runner.generate(prompt, cache=cache, max_new_tokens=new,
                                           do_sample=False, eos_token_id=None)
        monkeypatch.undo()
        cache.check()  # the steps' values, checked once afterwards
    assert entered.count("update") == entered.count("_write_and_attend") == 2 * (new - 1)
    assert len(cache.packed_layers[0].store.pages[0]) >= 2  # pages were sealed
    assert torch.equal(out["torch"], out[backend])


def test_continuous_batching_decodes_without_host_work(monkeypatch):
    """Every layer's decode call of a continuous-batching forward through the CPU op (rows
    joining and leaving; pages sealed at commit, between forwards) makes no sync and no device
    tensor from a list; each request's tokens are its solo run's."""
    from kvmix.serving.paged import generate_batch

    model = tiny_llama(seed=4)
    method = method_string("kivi2")
    prompts = [torch.randint(1, 97, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (20, 37, 9)]
    solo = [generate_batch(model, [p], method, 24, 1e8, "cpu")[0] for p in prompts]
    entered: list = []
    with no_host_work(monkeypatch):
        guarded(monkeypatch, KVMixLayer, "decode", entered)
        out = generate_batch(model, prompts, method, 24, 1e8, "cpu")
    assert len(entered) >= 2 * 23
    assert out == solo


def test_one_upload_per_step_for_every_layer_of_a_kind():
    """Both layers of the tiny Llama read the same step metadata: 19 decode steps upload the
    step's lists 19 times, and the block table only at the first step and when pages were
    sealed, not once per layer."""
    model = tiny_llama(seed=5)
    cache = kvmix.make_cache(model, method_string("kivi2"), backend="cpu")
    layers = cache.packed_layers
    assert len(layers) == 2 and all(layer.kind is layers[0].kind for layer in layers)
    prompt = torch.randint(1, 97, (3, 30), generator=torch.Generator().manual_seed(5))
    seals = []
    keep = type(layers[0].store).keep

    def counted(store, sealing):
        before = sum(map(len, store.pages))
        keep(store, sealing)
        seals.append(sum(map(len, store.pages)) > before)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(layers[0].store), "keep", counted)
        with torch.no_grad():
            model.generate(prompt, cache=cache, max_new_tokens=20, do_sample=False,
                           eos_token_id=None)
    steps, sealing = len(seals) // 2, sum(seals[::2])  # layer 0's steps that sealed
    assert steps == 19 and sealing >= 2
    assert steps + 1 <= meta(layers[0].kind).uploads <= steps + 1 + sealing


def test_layers_out_of_lockstep_get_their_own_metadata():
    """Two layers of one kind driven with different lengths (as no model does, but a caller
    can): each reads its own spans, slots and table, and its outputs equal the reference's."""
    from helpers import assert_near, left_padded, make, op_tolerance

    from kvmix.runtime.layer import take_pending

    caches = {b: make("kivi2", backend=b) for b in ("cpu", "torch")}
    outs = {}
    for backend, cache in caches.items():
        outs[backend] = []
        for layer, lengths in ((0, [45, 9]), (1, [30, 12])):
            keys, values, queries = tokens(2, max(lengths), seed=layer, dtype=torch.float32)
            cache.update(keys, values, layer)
            take_pending().attend(cache.method.transform_queries(queries, layer),
                                  left_padded(lengths), 0.2)
        for i in range(3):
            for layer in (0, 1):
                keys, values, queries = tokens(2, 1, seed=10 + i, dtype=torch.float32)
                cache.update(keys, values, layer)
                outs[backend].append(take_pending().attend(
                    cache.method.transform_queries(queries, layer), None, 0.2))
    stores = [layer.store for layer in caches["cpu"].packed_layers]
    assert stores[0].kind is stores[1].kind
    assert [len(p) for p in stores[0].pages] != [len(p) for p in stores[1].pages]
    assert meta(stores[0].kind).uploads >= 2 * 3  # each layer's step its own upload
    tolerance = op_tolerance(caches["cpu"].method, cpu)
    for fast, exact in zip(outs["cpu"], outs["torch"], strict=True):
        assert_near(fast, exact, tolerance)


def test_staged_buffers_keep_their_address_until_they_grow():
    staged = Upload()
    first = staged.fill([1, 2, 3], torch.device("cpu"))
    again = staged.fill([4, 5], torch.device("cpu"))
    assert again.tolist() == [4, 5] and again.data_ptr() == first.data_ptr()
    grown = staged.fill(list(range(40)), torch.device("cpu"))
    assert grown.tolist() == list(range(40)) and staged.buffer.numel() == bucket(40) == 64


# ---- a Triton decode step launches with the same arguments from step to step ----------------


def _launch_record(value):
    """A launch argument as compared: a tensor by address, shape, strides and dtype; tuples
    element by element; constexprs by value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, tuple):
        return tuple(map(_launch_record, value))
    return getattr(value, "value", value)


class Recorder:
    """Stands for a Triton kernel: records each launch (grid, arguments), keeps its arguments
    alive, and runs it."""

    def __init__(self, name: str, kernel, launches: list):
        self.name, self.kernel, self.launches, self.kept = name, kernel, launches, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # the arguments kept alive: a temporary copy made for one launch (a stale
            # .contiguous(), say) cannot free its memory for the next one's to reuse the
            # address, so the comparison sees it
            self.kept.append(args)
            self.launches.append((self.name, grid, [_launch_record(a) for a in args],
                                  sorted(kwargs.items())))
            return self.kernel[grid](*args, **kwargs)
        return launch


@pytest.mark.skipif(not gpu.available()[0], reason="Triton is not installed")
@pytest.mark.parametrize("name", ["kivi2", "wush"])
def test_a_triton_step_launches_with_the_same_arguments_across_steps(name, monkeypatch):
    """Seven decode steps of a ragged batch in a pool sized up front, sealing pages (the block
    table's contents change), launch the page kernel and the merge with equal grids, scalars,
    constexprs and tensors (address, shape, strides), but for the step's query and the merge's
    output (in a captured graph: its static input and output): what a graph captured once
    replays. Page counts are read on the device, so they are not in the launch."""
    from helpers import make

    cache = make(name, backend="triton", max_batch=3, max_tokens=64)  # a pool sized up front
    prefill(cache, [45, 14, 30], device=TRITON_DEVICE)
    step(cache, 3, seed=99, device=TRITON_DEVICE)  # the first step builds what later reuse
    launches: list = []
    for kernel in ("_pages", "_merge"):
        monkeypatch.setattr(gpu, kernel, Recorder(kernel, getattr(gpu, kernel), launches))
    store = cache.layers[0].store
    pages = [len(p) for p in store.pages]
    width = store.steps.table(store).width
    for i in range(7):  # every row seals a page
        step(cache, 3, seed=100 + i, device=TRITON_DEVICE)
    assert [len(p) for p in store.pages] != pages  # pages were sealed in between
    assert store.steps.table(store).width == width  # one bucket
    pages_kernel = [launch for launch in launches if launch[0] != "_merge"]
    merges = [launch for launch in launches if launch[0] == "_merge"]
    assert len(pages_kernel) == len(merges) == 7  # two launches per step
    for launches_of, output in ((pages_kernel, None), (merges, 3)):
        held = [(grid, [a for i, a in enumerate(args) if i not in (0, output)], kw)
                for _, grid, args, kw in launches_of]
        assert all(launch == held[0] for launch in held)
    assert len({launch[2][0][1] for launch in pages_kernel}) > 1  # the query is each step's
