"""What a server's ``/metrics`` reports, measured in its generation loop: requests running and
waiting, output tokens per second over a recent window, time to first token, and the cache's
figures (pages, bytes held, reserved, the budget), read after every step by the loop's own
thread (the HTTP thread reads the copy)."""

from __future__ import annotations

import threading
from collections import deque
from time import perf_counter
from typing import Any

WINDOW = 10.0  # seconds of steps behind the tokens/s figure


class Stats:
    def __init__(self):
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()  # (end of a step, tokens it output)
        self.values: dict[str, float] = {"running": 0, "waiting": 0, "steps": 0,
                                         "output_tokens": 0, "ttft_sum": 0.0, "ttft_count": 0,
                                         "faulted_steps": 0, "faulted_requests": 0}

    def record(self, processor: Any) -> None:
        """One forward of ``processor`` (a ContinuousBatchProcessor) just ran."""
        now = perf_counter()
        states = [f.state for f in processor.inputs_and_outputs.requests_in_batch
                  if f.has_new_token]
        firsts = [now - s.created_time for s in states if s.generated_len() == 0]
        with self._lock:
            self._recent.append((now, len(states)))
            while self._recent and self._recent[0][0] < now - WINDOW:
                self._recent.popleft()
            v = self.values
            v["steps"] += 1
            v["output_tokens"] += len(states)
            v["ttft_sum"] += sum(firsts)
            v["ttft_count"] += len(firsts)

    def count_faults(self, requests: int) -> None:
        """A step was contained, failing ``requests`` requests."""
        with self._lock:
            self.values["faulted_steps"] += 1
            self.values["faulted_requests"] += requests

    def refresh(self, processor: Any) -> None:
        """The gauges after a turn of the loop: requests running and waiting, the cache."""
        figures = cache_figures(processor.cache)
        scheduler = processor.scheduler
        with self._lock:
            self.values.update(figures, running=len(scheduler.active_requests),
                               waiting=len(scheduler.waiting_requests))

    def snapshot(self) -> dict[str, float]:
        """The figures now, with output tokens/s over the last ``WINDOW`` seconds."""
        now = perf_counter()
        with self._lock:
            values = dict(self.values)
            recent = [(t, n) for t, n in self._recent if t >= now - WINDOW]
        span = now - recent[0][0] if len(recent) > 1 else 0.0
        values["tokens_per_second"] = sum(n for _, n in recent[1:]) / span if span else 0.0
        return values


def cache_figures(cache: Any) -> dict[str, float]:
    """kvmix's pool reports its own; transformers' paged float cache: its tensor and the share
    of it in use."""
    if hasattr(cache, "figures"):
        return cache.figures()
    total = cache.cache_tensor.numel()
    free = cache.compute_free_capacity(relative=True)
    blocks = cache.num_blocks
    return {"pages_used": round(blocks * (1 - free)), "pages_free": round(blocks * free),
            "kv_usage": 1 - free,
            "cache_bytes": total, "cache_held_bytes": total * (1 - free),
            "cache_peak_bytes": total}
