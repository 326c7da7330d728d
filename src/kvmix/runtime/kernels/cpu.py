"""The fused CPU decode op (``decode.cpp``): built with the system C++ compiler on first use into
a cache keyed by the source, the torch version, the compiler and the CPU, then loaded as the
torch ops ``torch.ops.kvmix.decode`` and ``decode_batch`` (and the encoder's ``quantize`` and
``pack``, registered with ``kvmix.core.fused``).

``attend`` mirrors ``kvmix.runtime.kernels.reference.attend`` for a few new queries of one
sequence: the same inputs, the same output, without building a float history. On a CPU with
AVX-512 VNNI and VBMI, packed codes are dotted in integer SIMD with the float weights (the
pre-scaled query over key channels, p·scale over value tokens) rounded per block to two int8
planes: 16-bit precision relative to each block's largest weight, the one error added to the
float kernels' arithmetic (``describe`` says which kernels run).
``attend_batch`` is a decode step of the whole batch in one op call (``decode_batch``): every
sequence's float slots and its pages in the layer's pool, read through the block table. The
library also holds the vLLM plugin's step ops: ``assign_slots`` and ``plan_step`` (a step's
staging slots and plan, once for every layer), ``step`` (a layer's step in one call: its
seals encoded into their pages, then ``decode_batch``), ``seal_tokens``, ``encode_pages`` and
``write_pages`` (the seals made before it: a step's sealed groups gathered, encoded into
their pages, fields written) and ``put_values`` (values by token).
Flags: ``-O3 -march=native`` (the cache key holds the CPU); never ``-ffast-math`` (masked
scores are -inf). Threads come from torch's own pool: ``at::parallel_for`` is inline OpenMP in
torch's build, so the op is built with ``-fopenmp`` and resolves ``libgomp.so.1`` to the copy
torch ships and has loaded.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kvmix.core import fused
from kvmix.core.paths import cache_root
from kvmix.methods import ChannelKeys, KernelView
from kvmix.runtime.kernels import batch
from kvmix.runtime.store import BatchStore, RowView

SOURCE = Path(__file__).with_name("decode.cpp")  # the op's entry; its parts in decode/*.h
PARTS = sorted(Path(__file__).with_name("decode").glob("*.h"))
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


def unserved(method, head_dim: int) -> str:
    """Why the op cannot read ``method``'s blocks ("" when it can): it tiles blocks of a
    multiple of 8 tokens and channel groups of a multiple of 8 channels."""
    sizes = {"group": method.group, "value_group": getattr(method, "value_group", None),
             "block": getattr(method, "block", None)}  # tokens, value and WUSH channel groups
    for name, size in sizes.items():
        if size is not None and size % 8:
            return f"{name}={size} is not a multiple of 8, which the CPU decode op tiles"
    return ""


def call(op: str, *args, **kwargs) -> torch.Tensor:
    """``torch.ops.kvmix.<op>`` without torch's ``__torch_function__`` probe of its arguments
    (none of them overrides torch; the probe of each TorchScript object, its missing attribute
    raised and caught as a C++ exception, costs tens of µs a call, more than a small decode),
    and through its one overload's C++ entry (``_entry``)."""
    with torch._C.DisableTorchFunction():
        return _entry(op)(*args, **kwargs)


@functools.cache
def _entry(op: str):
    """The C++ function behind ``torch.ops.kvmix.<op>.default``: called directly, it skips the
    Python-side walk of every argument torch's op objects make for ops that take TorchScript
    objects (a search for fake ones, used only while tracing; ~5 µs a call of ``step``)."""
    load()
    return getattr(torch.ops.kvmix, op).default._op


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
    float_keys = [_segment(k) for k, _ in segments]
    float_values = [_segment(v) for _, v in segments]
    out = call("decode", _float32(query[0]), scaling, float_keys, float_values, 1,
               row.method.group, row.lengths if view else [], *op_layouts(packed_layouts(view)))
    return out.unsqueeze(0).to(dtype)


# the float segments kvmix's own runtime hands the op as they are (the op also reads bfloat16,
# the vLLM plugin's staging; the runtime's bfloat16 slots go through ``attend``, in float32)
SEGMENT_DTYPES = (torch.float32, torch.float16)
INTEGER_FLAGS = ("avx512bw", "avx512_vnni", "avx512vbmi")  # /proc/cpuinfo names


def integer() -> bool:
    """Whether the op here dots packed codes in integer SIMD (see ``describe``)."""
    return available()[0] and torch.ops.kvmix.simd() == "avx512-vnni"


def timings() -> dict[str, float]:
    """The op's time by part (``decode`` and ``decode_batch``) since the last read, in µs
    summed over the op's threads (``calls``: how many; ``wall``: the calls' own time, on the
    caller's thread), then reset. Counted only where ``KVMIX_OP_TIMING=1`` was set before the
    op loaded; else all zero."""
    load()
    values = torch.ops.kvmix.op_timings().tolist()
    return dict(zip(torch.ops.kvmix.op_parts().split(","), values, strict=True))


def describe() -> str:
    """Which kernels the op runs here, and why: integer dot products where the CPU has AVX-512
    VNNI and VBMI (the build's -march=native enables them), else the portable float kernels."""
    ok, cause = available()
    if not ok:
        return f"unavailable ({cause.splitlines()[0]})"
    if integer():
        return ("integer dot products (AVX-512 VNNI + VBMI; query weights rounded to 16 bits "
                "per block)")
    flags = _cpu_flags().split()
    missing = [flag for flag in INTEGER_FLAGS if flag not in flags]
    why = f"this CPU lacks {', '.join(missing)}" if missing else "the compiler did not enable them"
    return f"float kernels (portable: {why})"


def batched(store: BatchStore) -> bool:
    """Whether ``attend_batch`` reads this store: float32 or float16 slots and, once pages
    exist, a view of them the op reads (float32 float pages, or packed ones whose groups are
    multiples of 8); other methods go through ``attend`` per sequence."""
    if store.keys.dtype not in SEGMENT_DTYPES:
        return False
    pool = batch.pool_view(store)
    if pool is None or pool.view is None:
        return pool is not None
    keys = pool.view.keys
    if isinstance(keys, torch.Tensor):
        return keys.dtype == torch.float32
    return store.method.group % 8 == 0 and pool.view.values.group % 8 == 0


def prepare(store: BatchStore) -> None:
    """Build what ``attend_batch`` reuses (the per-sequence views: one ``kernel_view`` call per
    distinct selection) at the prompt, so that decode steps do not."""
    if store.keys.dtype in SEGMENT_DTYPES:
        batch.pool_view(store)


def attend_batch(store: BatchStore, query: torch.Tensor, scaling: float) -> torch.Tensor:
    """A decode step: query [B, Hq, 1, D] of each sequence's new token, already written to its
    slot, over everything the sequence holds and sees -> [B, Hq, 1, D]."""
    table, step = store.steps.table(store), store.step
    out = call("decode_batch", query_rows(query[:, :, 0]), scaling, store.keys, store.values,
               step.spans, store.method.group, table.pages, table.held, table.counts,
               *_pool_arguments(batch.pool_view(store)),
               skip=step.skips if store.window is not None else None)
    return out.unsqueeze(2).to(query.dtype)


def _pool_arguments(pool: batch.PoolView) -> list:
    """The op's arguments after ``counts``: float pages [P, H, G, D] (keys, values), then the
    packed layouts of the pool with each sequence's plane channels, multipliers and key
    offsets (built once per pool view)."""
    return batch.arguments(pool, "cpu", built_arguments)


def page_pool(pool: batch.PoolView):
    """The pool of a pool view as ``kvmix::step`` reads it: one ``PagePool`` object (float
    pages, or packed layouts with each row's plane channels), built once per view."""
    return batch.arguments(pool, "cpu-pool",
                           lambda view: torch.classes.kvmix.PagePool(*_pool_arguments(view)))


def built_arguments(pool: batch.PoolView) -> list:
    """The op's pool arguments of a pool view (what ``batch.arguments`` keeps per view)."""
    if pool.view is not None and isinstance(pool.view.keys, torch.Tensor):
        return [pool.view.keys, pool.view.values, None, None, None]
    layouts = packed_layouts(pool.view)
    if pool.offset is not None:
        layouts[0] = dataclasses.replace(layouts[0], index=pool.index, mult=pool.mult,
                                         offset=pool.offset)
    return [None, None, *op_layouts(layouts)]


def _float_blocks(view: KernelView, lengths: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Float blocks [n, H, G, D] as segments; a block a crop cut short is its own segment."""
    whole = [i for i, held in enumerate(lengths) if held == view.keys.shape[2]]
    if len(whole) == len(lengths):
        return [(view.keys, view.values)]
    return [(view.keys[i : i + 1, :, :held].contiguous(), view.values[i : i + 1, :, :held]
             .contiguous()) for i, held in enumerate(lengths)]


@dataclass
class Planes:
    """Per-channel keys as the op reads them (``torch.classes.kvmix.ChannelPlanes``): per plane
    its codes, width, channels and multipliers; the blocks' scale and minimum; key offsets."""

    codes: list[torch.Tensor]
    bits: list[int]
    index: list[torch.Tensor]
    mult: list[torch.Tensor]
    scale: torch.Tensor
    minimum: torch.Tensor
    offset: torch.Tensor

    def op(self):
        return torch.classes.kvmix.ChannelPlanes(self.codes, self.bits, self.index, self.mult,
                                                 self.scale, self.minimum, self.offset)


@dataclass
class Groups:
    """Per-token groups as the op reads them (``torch.classes.kvmix.TokenGroups``): values,
    and per-token keys (WUSH, rotations); ``minimum`` None for symmetric groups."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor | None
    bits: int
    group: int

    def op(self):
        return torch.classes.kvmix.TokenGroups(self.codes, self.scale, self.minimum, self.bits,
                                               self.group)


def packed_layouts(view: KernelView | None) -> list:
    """The op's packed arguments as (planes, per-token keys, values), one of the first two
    None; all None without packed blocks."""
    if view is None:
        return [None, None, None]
    keys, values = view.keys, view.values
    groups = Groups(values.codes, values.scale, values.minimum, values.bits, values.group)
    if isinstance(keys, ChannelKeys):
        planes = keys.planes
        return [Planes([p.codes for p in planes], [p.bits for p in planes],
                       [p.index for p in planes], [p.mult for p in planes], keys.scale,
                       keys.minimum, keys.offset), None, groups]
    return [None, Groups(keys.codes, keys.scale, keys.minimum, keys.bits, keys.group), groups]


def op_layouts(layouts: list) -> list:
    """``packed_layouts`` as the op's TorchScript objects."""
    return [None if layout is None else layout.op() for layout in layouts]


def _segment(x: torch.Tensor) -> torch.Tensor:
    """A float segment as the op reads it: float16 slots as they are, anything else float32."""
    return x.contiguous() if x.dtype in SEGMENT_DTYPES else x.float().contiguous()


def query_rows(query: torch.Tensor) -> torch.Tensor:
    """query [S, Hq, D] as ``decode_batch`` reads it: float32, each row's heads contiguous; its
    rows may lie apart (vLLM's query is a view of its fused qkv: no copy)."""
    query = query.float()
    D = query.shape[-1]
    return query if query.stride(-1) == 1 and query.stride(-2) == D else query.contiguous()


def _float32(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous() if x.dtype == torch.float32 else x.float().contiguous()


def _cache_dir() -> Path:
    return cache_root() / "kernels" / _cache_key()


def _flags() -> tuple[str, ...]:
    """FLAGS, then any the user adds in KVMIX_CXXFLAGS (e.g. -mno-avx512vnni: the portable
    float kernels on a CPU that has the integer instructions)."""
    return FLAGS + tuple(os.environ.get("KVMIX_CXXFLAGS", "").split())


def _cache_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    for part in PARTS:
        digest.update(part.read_bytes())
    for part in (torch.__version__, sys.version, platform.machine(), _cpu_flags(),
                 _compiler_version(), " ".join(_flags())):
        digest.update(part.encode())
    return digest.hexdigest()[:16]


def _build(library: Path) -> None:
    """g++ with torch's headers and libraries into ``library`` (atomically)."""
    root = Path(torch.__file__).parent
    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_suffix(f".{os.getpid()}.tmp")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [_compiler(), *_flags(), abi, f"-I{root / 'include'}", str(SOURCE), "-o",
               str(partial), f"-L{root / 'lib'}", "-ltorch", "-ltorch_cpu", "-lc10",
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


fused.register_cpu(fused.CpuEncoder(lambda *args: call("quantize", *args),
                                    lambda *args: call("quantize_mixed", *args),
                                    lambda *args: call("selected_channels", *args),
                                    lambda rows, bits: call("pack", rows, bits),
                                    lambda: available()[0]))
