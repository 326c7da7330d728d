"""Process memory while work runs: the figure that says whether a cache really saves memory,
beside what the cache reports.

``heap_bytes`` is what the C allocator has handed out and not taken back (glibc's
``mallinfo2``: arena bytes in use plus mmapped blocks); torch's CPU tensors live there, so it
rises and falls with them, unlike the resident set, which keeps freed pages. Where
``mallinfo2`` is missing it falls back to the resident set size.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
import time
from typing import Any


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


@functools.cache
def _mallinfo2():
    try:
        function = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def heap_bytes() -> int:
    """Bytes the allocator has in use now (or the resident set, where it cannot be asked)."""
    info = _mallinfo2()
    if info is None:
        return rss_bytes()
    stats = info()
    return stats.uordblks + stats.hblkhd


def rss_bytes() -> int:
    """Resident set size of this process now."""
    with open(f"/proc/{os.getpid()}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakMemory:
    """``with PeakMemory() as memory:`` samples ``heap_bytes`` every ``interval`` seconds in a
    thread; ``memory.peak`` is the largest seen (at least the values at entry and exit)."""

    def __init__(self, interval: float = 0.001):
        self.interval = interval
        self.peak = 0

    def __enter__(self) -> PeakMemory:
        self.peak = heap_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, heap_bytes())

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, heap_bytes())
            time.sleep(self.interval)


def memory_bandwidth(megabytes: int = 256, repeats: int = 5, device: str = "cpu") -> float:
    """The copy bandwidth of ``device``'s memory, bytes/s (read + write), the best of a few
    large copies."""
    import torch

    source = torch.ones(megabytes * 2**20 // 4, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * source.nbytes / best


def synchronize(device: str | Any) -> None:
    """Wait for ``device``'s queued work (a CUDA device; nothing on CPU): a timer's edges."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def matmul_flops(size: int = 1024, repeats: int = 5) -> float:
    """This machine's float32 matrix-multiply FLOP/s, the best of a few."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best
