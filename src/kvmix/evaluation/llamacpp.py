"""llama.cpp as an anchor beside kvmix: one build of the llama.cpp that the ``engine`` extra's
llama-cpp-python vendors, correct on any x86 CPU, and what runs on it.

The build (``make engine``; ``python -m kvmix.evaluation.llamacpp``) takes llama-cpp-python's
source release from the package index, configures its ``vendor/llama.cpp`` with runtime CPU
dispatch (``GGML_BACKEND_DL`` + ``GGML_CPU_ALL_VARIANTS``: one ``libggml-cpu-<variant>.so`` per
x86 level, the best one the CPU supports loaded at start, no ISA flag guessed) and builds
``llama-server`` with the shared libraries into ``$KVMIX_CACHE/llama.cpp/<version>/build/bin``.
The Python bindings load the same libraries (``LLAMA_CPP_LIB_PATH``), so ``llama-server`` and
``kvmix bench``'s batch-1 rows run one build.

Bytes per cached token follow ``ggml_row_size`` of each side's type over the model's
``n_embd_k_gqa``/``n_embd_v_gqa``; a slot's context is the request's tokens rounded up to
llama.cpp's 256 cells, so the slot count is the largest whose cache fits a budget. Slots are
llama-server's default for a set count: one stream each. A unified cache (``-kvu``) packs more
requests into the same bytes, but every token then attends over every slot's cells (masked):
12 unified f16 slots served 27.8 output tokens/s where 10 separate ones served 38.5 (24 clients
of 512 + 96 tokens in 180 MB, two runs the same hour on 2 cores).
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from kvmix.core.paths import cache_root
from kvmix.evaluation.loadtest import LocalServer, ServerDown, log_tail
from kvmix.runtime.cache import model_spec

PREFIX = "llama.cpp:"  # a row that runs llama.cpp: llama.cpp:TYPE or llama.cpp:K/V
VERSION = "0.3.36"  # llama-cpp-python, as the engine extra pins it
INSTALL = (f"pip install 'llama-cpp-python=={VERSION}' (or make engine, which also builds "
           "llama-server)")
BUILD_HINT = "make engine (python -m kvmix.evaluation.llamacpp)"
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=ON", "-DGGML_NATIVE=OFF",
               "-DGGML_BACKEND_DL=ON", "-DGGML_CPU_ALL_VARIANTS=ON", "-DLLAMA_BUILD_SERVER=ON",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
               "-DLLAMA_USE_PREBUILT_UI=OFF", "-DLLAMA_OPENSSL=OFF"]
CELL_PAD = 256  # llama_context pads n_ctx to a multiple of 256 cells
GGML_TYPE_BF16 = 30  # ggml.h
# ggml's cache types: (elements per block, bytes per block), ggml.c's type traits.
TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q4_0": (32, 18),
         "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "iq4_nl": (32, 18)}


class EngineMissing(RuntimeError):
    """llama.cpp is not installed or not built here; the message says what to run."""


def root() -> Path:
    return cache_root() / "llama.cpp" / VERSION


def bin_dir() -> Path:
    return root() / "build" / "bin"


def server_binary() -> Path:
    """The built ``llama-server``; EngineMissing naming the build command when absent."""
    binary = bin_dir() / "llama-server"
    if not binary.is_file():
        raise EngineMissing(f"llama-server is not built (looked for {binary}); run {BUILD_HINT}")
    return binary


@functools.cache
def server_version() -> str:
    """``llama-server --version``: the llama.cpp build number, commit and compiler."""
    answer = subprocess.run([str(server_binary()), "--version"], capture_output=True,
                            text=True, timeout=60)
    return " ".join((answer.stdout + answer.stderr).split())


def build(jobs: int | None = None) -> Path:
    """Download llama-cpp-python's source release, configure its vendored llama.cpp with
    runtime CPU dispatch and build ``llama-server`` (about 25 minutes on 2 cores, once)."""
    source = _vendored_source()
    build_dir = root() / "build"
    log = root() / "build.log"
    with log.open("w") as out:
        for command in (["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS],
                        ["cmake", "--build", str(build_dir), "--target", "llama-server",
                         "--parallel", str(jobs or os.cpu_count() or 1)]):
            if subprocess.run(command, stdout=out, stderr=subprocess.STDOUT).returncode:
                raise EngineMissing(f"llama.cpp build failed: {' '.join(command[:2])}; "
                                    f"its output is in {log}")
    return server_binary()


def _vendored_source() -> Path:
    """``vendor/llama.cpp`` of llama-cpp-python's source release, downloaded once."""
    source = root() / "src" / f"llama_cpp_python-{VERSION}"
    if not (source / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        (root() / "src").mkdir(parents=True, exist_ok=True)
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                    "--no-binary", ":all:", f"llama-cpp-python=={VERSION}", "-d",
                    str(root() / "src")]
        if subprocess.run(download).returncode:
            raise EngineMissing(f"could not download llama-cpp-python=={VERSION}'s source "
                                "release from the package index")
        with tarfile.open(root() / "src" / f"llama_cpp_python-{VERSION}.tar.gz") as archive:
            archive.extractall(root() / "src", filter="data")
    return source / "vendor" / "llama.cpp"


@functools.cache
def bindings() -> Any:
    """``llama_cpp`` (the engine extra), on this build's libraries when it is built (every CPU
    variant registered from ``bin_dir()``), else on the libraries it was installed with."""
    if (bin_dir() / "libllama.so").is_file():
        os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(bin_dir()))
    try:
        import llama_cpp
    except ImportError as error:
        raise EngineMissing(f"llama.cpp's Python bindings are not installed ({error}); run "
                            f"{INSTALL}") from error
    if Path(os.environ.get("LLAMA_CPP_LIB_PATH", "")) == bin_dir():
        ggml = ctypes.CDLL(str(bin_dir() / "libggml.so"), mode=ctypes.RTLD_GLOBAL)
        ggml.ggml_backend_load_all_from_path(str(bin_dir()).encode())
    return llama_cpp


def ggml_type(name: str) -> int:
    """The bindings' ``GGML_TYPE_*`` number of a cache type (bf16: ggml.h's, which
    llama-cpp-python 0.3.36 does not export)."""
    return GGML_TYPE_BF16 if name == "bf16" else getattr(bindings(), f"GGML_TYPE_{name.upper()}")


class Decoder:
    """llama.cpp's batch-1 decode through the Python bindings, called as ``kvmix bench`` calls a
    model: ``decoder(ids [1, T]) -> .logits [1, 1, V]`` (the last position) with the context of
    ``context`` tokens as its cache; ``nbytes()`` is the cache llama.cpp allocates for it."""

    device = torch.device("cpu")

    def __init__(self, gguf: Path, config: Any, k: str, v: str, context: int, threads: int):
        self.llm = bindings().Llama(
            model_path=str(gguf), n_ctx=context, n_batch=512, n_ubatch=512, flash_attn=True,
            type_k=ggml_type(k), type_v=ggml_type(v), n_threads=threads,
            n_threads_batch=threads, verbose=False)
        self.cache_bytes = self.llm.n_ctx() * cache_bytes_per_token(config, k, v)

    def __call__(self, ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        self.llm.eval(ids[0].tolist())
        last = bindings().llama_get_logits_ith(self.llm.ctx, -1)  # the batch's last row
        logits = np.ctypeslib.as_array(last, shape=(self.llm.n_vocab(),)).copy()
        return SimpleNamespace(logits=torch.from_numpy(logits)[None, None])  # [1, 1, V]

    def nbytes(self) -> int:
        return self.cache_bytes


def cache_bytes_per_token(config: Any, k: str, v: str) -> int:
    """Bytes llama.cpp's cache holds per token at these K/V types: ``ggml_row_size`` of each
    side over every layer's ``n_embd_k_gqa``/``n_embd_v_gqa`` (a transformers config)."""
    spec = model_spec(config)
    width = spec.n_kv_heads * spec.head_dim
    return spec.n_layers * sum(_row_bytes(kind, width) for kind in (k, v))


def _row_bytes(kind: str, elements: int) -> int:
    block, size = TYPES[kind]
    return elements // block * size


def settings(names: list[str]) -> list[str]:
    """The llama.cpp rows (``llama.cpp:…``) among method or baseline names."""
    return [name for name in names if name.startswith(PREFIX)]


def parse_types(setting: str) -> tuple[str, str]:
    """``llama.cpp:TYPE`` or ``llama.cpp:K/V`` -> (K type, V type); ValueError naming the valid
    types."""
    kinds = setting.removeprefix(PREFIX).split("/")
    if len(kinds) == 1:
        kinds *= 2
    if len(kinds) != 2 or any(kind not in TYPES for kind in kinds):
        raise ValueError(f"method={setting!r} is invalid; expected llama.cpp:TYPE or "
                         f"llama.cpp:K/V with types {', '.join(TYPES)}")
    return kinds[0], kinds[1]


@dataclass
class SlotPlan:
    """llama-server's slots within a budget: ``slots`` streams of ``per_slot`` cells each
    (``-c cells -np slots``, not unified: each slot attends over its own cells only), each
    holding one request of ``per_request`` tokens."""

    k: str
    v: str
    slots: int
    per_request: int
    per_slot: int  # per_request rounded up as llama.cpp rounds n_ctx_seq: to 256 cells
    cells: int
    bytes: int  # the cache llama.cpp allocates: cells x bytes per token


def plan_slots(config: Any, k: str, v: str, budget: int, per_request: int,
               most: int) -> SlotPlan:
    """The most slots (at most ``most``) whose cache fits ``budget`` bytes, each slot's context
    rounded up to llama.cpp's 256 cells (``GGML_PAD(n_ctx_seq, 256)``); ValueError when none
    fits."""
    budget, per_token = int(budget), cache_bytes_per_token(config, k, v)
    per_slot = -(-per_request // CELL_PAD) * CELL_PAD
    slots = min(most, budget // (per_slot * per_token))
    if slots < 1:
        raise ValueError(f"memory={budget} bytes fits no llama.cpp slot at {k}/{v}: one request "
                         f"of {per_request} tokens needs a {per_slot * per_token}-byte cache "
                         f"({per_token} bytes per token, {per_slot} cells)")
    return SlotPlan(k, v, slots, per_request, per_slot, slots * per_slot,
                    slots * per_slot * per_token)


class LlamaServer(LocalServer):
    """``llama-server`` for one slot plan, until the block ends: the same GGUF, ``threads``,
    flash attention, the plan's K/V types and slots, ``/metrics`` on, the host prompt cache off
    (``--cache-ram 0``: no cache outside the budget). ``reported_bytes`` is the cache size
    llama.cpp logs at load, ``cpu_variant`` the CPU backend it loaded."""

    timeout = 120.0  # seconds to load and answer /health

    def __init__(self, gguf: Path, plan: SlotPlan, threads: int, log: Path):
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


if __name__ == "__main__":
    print(build())
