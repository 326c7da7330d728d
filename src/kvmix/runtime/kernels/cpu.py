"""The fused CPU decode op (``decode.cpp``): built with the system C++ compiler on first use into
a cache keyed by the source, the torch version, the compiler and the CPU, then loaded as the
torch op ``torch.ops.kvmix.decode``.

``attend`` mirrors ``kvmix.runtime.kernels.reference.attend`` for a few new queries of one
sequence: the same inputs, the same output, without building a float history.
``attend_batch`` is a decode step of the whole batch in one op call (``decode_batch``): every
sequence's float slots and its pages in the layer's pool, read through the block table.
Flags: ``-O3 -march=native`` (the cache key holds the CPU); never ``-ffast-math`` (masked
scores are -inf). Threads come from torch's own pool: ``at::parallel_for`` is inline OpenMP in
torch's build, so the op is built with ``-fopenmp`` and resolves ``libgomp.so.1`` to the copy
torch ships and has loaded.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
import sys
import weakref
from pathlib import Path

import torch

from kvmix.core.tree import map_tensors
from kvmix.methods import ChannelKeys, KernelView
from kvmix.runtime.store import BatchStore, RowView

SOURCE = Path(__file__).with_name("decode.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++20", "-shared", "-fPIC", "-w")
MAX_QUERIES = 16  # longer chunks (a prefill) go to the reference path's SDPA


class KernelUnavailable(RuntimeError):
    """The op could not be built or loaded; the message says why."""


@functools.cache
def load() -> None:
    """Build (once per cache key) and load the op; KernelUnavailable with the cause if not."""
    library = _cache_dir() / "kvmix_decode.so"
    if not library.is_file():
        _build(library)
    try:
        torch.ops.load_library(str(library))
    except OSError as error:
        raise KernelUnavailable(f"loading {library} failed: {error}") from error


def available() -> tuple[bool, str]:
    """(True, "") when the op runs here, else (False, the cause)."""
    try:
        load()
    except KernelUnavailable as error:
        return False, str(error)
    return True, ""


def attend(row: RowView, view: KernelView | None, query: torch.Tensor, keys: torch.Tensor,
           values: torch.Tensor, scaling: float) -> torch.Tensor:
    """query [1, Hq, q, D] of the new tokens keys, values [1, H, q, D] over everything ``row``
    holds (its blocks read through ``view``) and themselves, causally -> [1, Hq, q, D]."""
    dtype = query.dtype
    floats = [(row.sink_keys, row.sink_values), (row.res_keys, row.res_values)] if len(row) else []
    if view is not None and isinstance(view.keys, torch.Tensor):  # float blocks
        floats += _float_blocks(view, row.lengths)
        view = None
    segments = [(k, v) for k, v in floats if k.shape[-2]] + [(keys, values)]
    float_keys = [_float32(k) for k, _ in segments]
    float_values = [_float32(v) for _, v in segments]
    packed = _packed_arguments(row, view)
    out = torch.ops.kvmix.decode(_float32(query[0]), scaling, float_keys, float_values, 1,
                                 row.method.group, *packed)
    return out.unsqueeze(0).to(dtype)


# Per store: (versions, arguments) of the pool's view and of the block table, rebuilt when
# selections, the pool's tensors or the table change (kept outside the cache: its bytes are
# the cache's own only).
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def batched(store: BatchStore) -> bool:
    """Whether ``attend_batch`` reads this store: float32 slots and, once pages exist, a
    packed kernel view of them (``full``'s float pages and methods without a fast path go
    through ``attend`` per sequence)."""
    return store.keys.dtype == torch.float32 and _pool_arguments(store) is not None


def prepare(store: BatchStore) -> None:
    """Build the arguments ``attend_batch`` reuses (per-sequence plane views: one
    ``kernel_view`` call per sequence), so that decode steps do not."""
    if store.keys.dtype == torch.float32:
        _pool_arguments(store)


def attend_batch(store: BatchStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A decode step: query [B, Hq, 1, D] of each sequence's new token, already written to its
    slot, over everything the sequence holds -> [B, Hq, 1, D]."""
    spans = torch.tensor(store.float_spans(), dtype=torch.long)  # [B, 4]
    out = torch.ops.kvmix.decode_batch(_float32(query[:, :, 0]), scaling, store.keys,
                                       store.values, spans, store.method.group,
                                       *_table(store), *_pool_arguments(store))
    return out.unsqueeze(2).to(query.dtype)


def _pool_arguments(store: BatchStore) -> list | None:
    key = (store.version, store.pool.version, store.batch, store.pool.pages is None)
    cached = _VIEWS.get(store)
    if cached is None or cached[0] != key:
        cached = key, _pool_view(store)
        _VIEWS[store] = cached
    return cached[1]


def _pool_view(store: BatchStore) -> list | None:
    """The op's arguments after ``counts``: float pages, or the pool's codes and statistics
    with per-sequence plane indices, multipliers and key offsets stacked [B, H, ...]; None
    where the pool has no view the op reads."""
    if store.pool.pages is None:
        return [None, None, *_packed_arguments(None, None)[1:]]
    pool = map_tensors(store.pool.pages, lambda t: t.unsqueeze(0))  # one "sequence" of pages
    selections = {id(s): s for s in store.selections}  # one view per distinct selection
    views = {key: store.method.kernel_view(pool, store.layer, s) for key, s in selections.items()}
    if any(v is None for v in views.values()) or store.method.group % 8:
        return None
    first = next(iter(views.values()))
    if isinstance(first.keys, torch.Tensor):  # float pages [P, H, G, D]
        if first.keys.dtype != torch.float32:
            return None
        return [first.keys, first.values, *_packed_arguments(None, None)[1:]]
    if first.values.group % 8:
        return None
    arguments = [None, None, *_packed_arguments(None, first)[1:]]
    if isinstance(first.keys, ChannelKeys):  # planes and offsets differ by selection
        planes = [views[id(s)].keys.planes for s in store.selections]
        count = range(len(first.keys.planes))
        arguments[4] = [torch.stack([p[i].index for p in planes]) for i in count]
        arguments[5] = [torch.stack([p[i].mult for p in planes]) for i in count]
        arguments[8] = torch.stack([views[id(s)].keys.offset.float()
                                    for s in store.selections]).contiguous()
    return arguments


def _table(store: BatchStore) -> list[torch.Tensor]:
    """pages, held [B, M] and counts [B], int64 (the block table, padded with page 0)."""
    cached = _TABLES.get(store)
    if cached is None or cached[0] != store.table_version:
        width = max(1, *(len(p) for p in store.pages))
        pad = [[0] * (width - len(p)) for p in store.pages]
        pages = torch.tensor([p + z for p, z in zip(store.pages, pad, strict=True)])
        held = torch.tensor([h + z for h, z in zip(store.held, pad, strict=True)])
        counts = torch.tensor([len(p) for p in store.pages])
        cached = store.table_version, [pages, held, counts]
        _TABLES[store] = cached
    return cached[1]


def _float_blocks(view: KernelView, lengths: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Float blocks [n, H, G, D] as segments; a block a crop cut short is its own segment."""
    whole = [i for i, held in enumerate(lengths) if held == view.keys.shape[2]]
    if len(whole) == len(lengths):
        return [(view.keys, view.values)]
    return [(view.keys[i : i + 1, :, :held].contiguous(), view.values[i : i + 1, :, :held]
             .contiguous()) for i, held in enumerate(lengths)]


def _packed_arguments(row: RowView | None, view: KernelView | None) -> list:
    """The op's arguments after ``group``: block lengths, channel planes, per-token keys,
    per-token values (empty when no block is held)."""
    if view is None:
        return [[], [], [], [], [], None, None, None, None, 0, 0, None, 0, 0, None, None]
    keys, values = view.keys, view.values
    if isinstance(keys, ChannelKeys):
        planes = ([p.codes for p in keys.planes], [p.bits for p in keys.planes],
                  [p.index for p in keys.planes], [p.mult for p in keys.planes])
        key_args = [keys.scale, keys.minimum, keys.offset, None, 0, 0]
    else:
        planes = ([], [], [], [])
        key_args = [keys.scale, keys.minimum, None, keys.codes, keys.bits, keys.group]
    return [row.lengths if row else [], *planes, *key_args, values.codes, values.bits,
            values.group,
            values.scale, values.minimum]


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()


def _cache_dir() -> Path:
    root = Path(os.environ.get("KVMIX_CACHE", Path.home() / ".cache" / "kvmix")) / "kernels"
    return root / _cache_key()


def _cache_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), _cpu_flags(),
                 _compiler_version(), " ".join(FLAGS)):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(library: Path) -> None:
    """g++ with torch's headers and libraries into ``library`` (atomically)."""
    root = Path(torch.__file__).parent
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [_compiler(), *FLAGS, abi, f"-I{root / 'include'}", str(SOURCE), "-o", str(partial),
               f"-L{root / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10",
               f"-Wl,-rpath,{root / 'lib'}"]
    try:
        result = subprocess.run(command, capture_output=True, text=True, check=False)
    except OSError as error:
        raise KernelUnavailable(f"no C++ compiler ({command[0]}): {error}") from error
    if result.returncode:
        raise KernelUnavailable(f"{command[0]} failed to build {SOURCE.name}:\n"
                                f"{result.stderr.strip()[-2000:]}")
    os.replace(partial, library)


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _compiler_version() -> str:
    try:
        return subprocess.run([_compiler(), "--version"], capture_output=True, text=True,
                              check=False).stdout
    except OSError:
        return "none"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()

