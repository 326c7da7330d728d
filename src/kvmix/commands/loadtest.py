"""``kvmix loadtest``: streamed completions at several concurrency levels against a server —
one given by ``--url``, or one ``kvmix serve`` per method it starts itself (a subprocess on
127.0.0.1, the same ``--memory`` for every method; ``transformers`` is transformers' own paged
float cache) — with requests/s, output tokens/s, time to first token and per output token
(p50/p99), failures, and the most requests running and cache bytes held at once, side by side
in ``results.json`` and plots."""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvmix.commands.args import config_from
from kvmix.evaluation.data import prompt_set
from kvmix.evaluation.loadtest import run_level, summary
from kvmix.evaluation.plots import scatter_lines
from kvmix.evaluation.report import console, print_table, write_results

COLUMNS = {"method": "method", "concurrency": "concurrency", "requests": "requests",
           "failures": "failed", "requests_per_s": "req/s",
           "output_tokens_per_s": "output tok/s", "ttft_p50_s": "TTFT p50 s",
           "ttft_p99_s": "TTFT p99 s", "tpot_p50_ms": "ms/token p50",
           "tpot_p99_ms": "ms/token p99", "peak_running": "most running",
           "peak_cache_mb": "peak cache MB"}


@dataclass
class LoadtestConfig:
    url: str | None = None  # a running server; else one kvmix serve per method
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2", "pnmix1",
                                                        "transformers"])
    model: str = "smollm2"
    memory: str = "180MB"
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    requests: list[int] = field(default_factory=lambda: [64])  # per level (one: every level)
    prompt: int = 512
    tokens: list[int] = field(default_factory=lambda: [128])  # a request's, in turn
    temperature: float = 0.0  # 0: greedy
    data: str = "prose"
    backend: str = "auto"
    max_batch_tokens: int = 2048
    timeout: float = 3600.0  # seconds a request may take, waiting included
    out: str | None = None


def add_parser(commands) -> None:
    parser = commands.add_parser("loadtest", help="requests/s, tokens/s, latency under load")
    defaults = LoadtestConfig()
    parser.add_argument("--url", default=None, help="a running server (else one per method)")
    parser.add_argument("--methods", default=",".join(defaults.methods),
                        help="servers to start: kvmix methods, 'transformers' (its own cache)")
    parser.add_argument("--model", default=defaults.model)
    parser.add_argument("--memory", default=defaults.memory, help="every server's KV budget")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--requests", default="64", help="per level, or one per level")
    parser.add_argument("--prompt", type=int, default=defaults.prompt, help="prompt tokens")
    parser.add_argument("--tokens", default="128",
                        help="output tokens of each request; several (64,128,256): in turn")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="sampling temperature of every request (0: greedy)")
    parser.add_argument("--data", default=defaults.data, help="prose, code or a text file")
    parser.add_argument("--backend", default=defaults.backend)
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens)
    parser.add_argument("--timeout", type=float, default=defaults.timeout)
    parser.add_argument("--out", default=None, help="folder for results.json and plots")
    parser.set_defaults(run=lambda args: run_loadtest(config_from(LoadtestConfig, args)))


def run_loadtest(config: LoadtestConfig) -> list[dict]:
    counts = _counts(config)
    from kvmix.models.loading import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    texts = [tokenizer.decode(ids) for ids in prompt_set(config.data, tokenizer, max(counts),
                                                         config.prompt)]
    rows = []
    for method in [None] if config.url else config.methods:
        with _server(config, method) as url:
            for concurrency, count in zip(config.concurrency, counts, strict=True):
                outcomes, wall, peaks = asyncio.run(run_level(
                    url, texts[:count], config.tokens, concurrency, config.timeout,
                    config.temperature))
                rows.append({"method": method or config.url, "resolved": _resolved(method),
                             "concurrency": concurrency,
                             **summary(outcomes, wall),
                             "peak_running": peaks.get("kvmix:num_requests_running"),
                             "peak_cache_mb": peaks.get("kvmix:cache_peak_bytes", 0) / 1e6,
                             "errors": sorted({o.error for o in outcomes if o.error})[:5]})
                console.print(f"{rows[-1]['method']} · concurrency {concurrency}: "
                              f"{rows[-1]['output_tokens_per_s']:.1f} output tok/s, "
                              f"{rows[-1]['failures']} failed")
    print_table(f"kvmix loadtest · {config.model} · {config.memory} · {config.prompt} + "
                f"{_tokens(config)} tokens · temperature {config.temperature:g}", rows, COLUMNS)
    if config.out:
        _write(config, rows)
    return rows


def _resolved(method: str | None) -> str | None:
    """The method with every parameter, as the server runs it."""
    from kvmix.methods import parse_method
    from kvmix.serving.launch import ANCHOR

    if method is None:
        return None
    if method == ANCHOR:
        return "transformers' ContinuousBatchingManager and PagedAttentionCache (SDPA, page 256)"
    return repr(parse_method(method))


def _counts(config: LoadtestConfig) -> list[int]:
    counts = config.requests * len(config.concurrency) if len(config.requests) == 1 \
        else config.requests
    if len(counts) != len(config.concurrency):
        raise ValueError(f"requests={config.requests} must be one count or one per "
                         f"concurrency level ({len(config.concurrency)})")
    for name, values in (("concurrency", config.concurrency), ("requests", counts),
                         ("prompt", [config.prompt]), ("tokens", config.tokens)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values} is invalid; expected integers >= 1")
    if not 0 <= config.temperature <= 2:
        raise ValueError(f"temperature={config.temperature} is invalid; expected 0 to 2")
    return counts


def _tokens(config: LoadtestConfig) -> str:
    return "/".join(map(str, config.tokens))


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


class _server:
    """``kvmix serve`` for ``method`` on a free port of 127.0.0.1 (or the given URL), until
    the block ends."""

    def __init__(self, config: LoadtestConfig, method: str | None):
        self.config, self.method, self.process = config, method, None

    def __enter__(self) -> str:
        if self.method is None:
            return self.config.url
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        c = self.config
        command = [sys.executable, "-m", "kvmix.cli", "serve", "--model", c.model, "--method",
                   self.method, "--memory", c.memory, "--port", str(port), "--backend",
                   c.backend, "--max-tokens", str(max(c.tokens)), "--max-batch-tokens",
                   str(c.max_batch_tokens), "--fit-prompt", str(c.prompt)]
        self.process = subprocess.Popen(command, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return url
            except httpx.HTTPError:
                time.sleep(0.5)
        self.__exit__()
        raise ValueError(f"kvmix serve --method {self.method} did not start")

    def __exit__(self, *exc) -> None:
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()


def _write(config: LoadtestConfig, rows: list[dict]) -> None:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for key, label, name in (("output_tokens_per_s", "output tokens/s", "throughput.png"),
                             ("ttft_p50_s", "time to first token p50 (s)", "ttft.png")):
        series = {}
        for row in rows:
            series.setdefault(row["method"], []).append((row["concurrency"], row[key]))
        plots.append(str(scatter_lines(out / name, series, "concurrent clients", label,
                                       f"{config.model} · {config.memory} KV · "
                                       f"{config.prompt} + {_tokens(config)} tokens")))
    path = write_results(out, "loadtest", config, rows, plots=plots,
                         client={name: _version(name) for name in ("httpx", "fastapi", "uvicorn",
                                                                    "openai")})
    console.print(f"wrote {path}")
