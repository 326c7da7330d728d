"""``llama-server`` for one ``llama.cpp:K/V`` row of ``kvmix loadtest``, its slots fitted to the
budget (``slots.fit_slots``), and the cache bytes it logs at start."""

from __future__ import annotations

import re
from pathlib import Path

from kvmix.engines.llamacpp.build import EngineMissing, server_binary
from kvmix.engines.llamacpp.slots import SlotFit
from kvmix.engines.process import LocalServer, ServerDown, log_tail


class LlamaServer(LocalServer):
    """``llama-server`` for one slot plan, until the block ends: the same GGUF, ``threads``,
    flash attention, the plan's K/V types and slots, ``/metrics`` on, the host prompt cache off
    (``--cache-ram 0``: no cache outside the budget). ``reported_bytes`` is the cache size
    llama.cpp logs at load, ``cpu_variant`` the CPU backend it loaded."""

    timeout = 120.0  # seconds to load and answer /health

    def __init__(self, gguf: Path, plan: SlotFit, threads: int, log: Path):
        super().__init__(log)
        self.gguf, self.plan, self.threads = gguf, plan, threads
        self.reported_bytes: int | None = None
        self.cpu_variant: str | None = None  # the libggml-cpu-<variant>.so loaded at start

    def command(self, port: int) -> list[str]:
        p = self.plan
        return [str(server_binary()), "--model", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(port), "--ctx-size", str(p.cells), "--parallel", str(p.slots),
                "--no-kv-unified", "--cache-type-k", p.k, "--cache-type-v", p.v,
                "--flash-attn", "on", "--threads", str(self.threads), "--threads-batch",
                str(self.threads), "--cache-ram", "0", "--metrics", "--no-webui",
                "--log-verbosity", "4"]  # 4: the load log names the cache size and CPU variant

    def __enter__(self) -> str:
        server_binary()  # not built: EngineMissing before anything is written
        try:
            url = super().__enter__()
        except ServerDown as error:
            raise EngineMissing(f"llama-server did not come up ({error}); its log {self.log} "
                                f"ends: {log_tail(self.log)}") from None
        log = self.log.read_text(errors="replace")
        self.reported_bytes = reported_cache_bytes(log)
        self.cpu_variant = next(iter(re.findall(r"libggml-cpu-([\w.]+)\.so", log)), None)
        return url


def reported_cache_bytes(log: str) -> int | None:
    """The cache size llama.cpp logs at load (``llama_kv_cache: size = X MiB``), in bytes."""
    sizes = re.findall(r"llama_kv_cache: size = +([\d.]+) MiB", log)
    return round(sum(float(size) for size in sizes) * 2**20) if sizes else None
