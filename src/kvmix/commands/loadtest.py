"""``kvmix loadtest``: streamed completions at several concurrency levels against a server —
one given by ``--url``, or one server per method and baseline it starts itself (a subprocess on
127.0.0.1, the same ``--memory`` for every one): ``kvmix serve`` for each of ``--methods``;
among ``--baselines``, ``transformers`` for transformers' own paged float cache,
``llama.cpp:TYPE`` (or ``llama.cpp:K/V``) for llama.cpp's own ``llama-server`` on the same GGUF
with that cache type and the most slots whose cache fits the budget
(``kvmix.engines.llamacpp.slots``), ``vllm:METHOD`` (or ``vllm:auto``, ``vllm:fp8``) for vLLM's
OpenAI server with kvmix's plugin (or its own cache) in the same bytes
(``kvmix.engines.vllm.server``) — with requests/s, output tokens/s, time to first token and
per output token (p50/p99), failures, the most requests running and cache bytes held at once,
and the seconds each server took to start (spawn to ``/health``), side by side in
``results.json`` and plots. An engine that is not built or does not come up is reported in its
row; the other servers still run."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvmix.bench.load import run_level, summary
from kvmix.capacity import parse_memory
from kvmix.commands.args import BACKEND_HELP, add_renamed, config_from, warn_renamed
from kvmix.engines.llamacpp.build import EngineMissing, server_version
from kvmix.engines.llamacpp.server import LlamaServer
from kvmix.engines.llamacpp.slots import PREFIX as LLAMA_PREFIX
from kvmix.engines.llamacpp.slots import SlotFit, fit_slots, parse_types
from kvmix.engines.process import LocalServer, ServerDown
from kvmix.engines.rows import engine_rows
from kvmix.engines.vllm import server as vllm_server
from kvmix.evaluation.data import prompt_set
from kvmix.jobs.plots import scatter_lines
from kvmix.jobs.report import console, print_table, version, write_results
from kvmix.methods import parse_method
from kvmix.serving.launch import ANCHOR

COLUMNS = {"method": "method", "concurrency": "concurrency", "requests": "requests",
           "failures": "failed", "requests_per_s": "req/s",
           "output_tokens_per_s": "output tok/s", "ttft_p50_s": "TTFT p50 s",
           "ttft_p99_s": "TTFT p99 s", "tpot_p50_ms": "ms/token p50",
           "tpot_p99_ms": "ms/token p99", "peak_running": "most running",
           "slots": "slots", "cache_tokens": "cache tokens", "peak_cache_mb": "peak cache MB",
           "startup_s": "start-up s"}
SLACK = 64  # tokens a vLLM request may take beyond its prompt and new tokens (it tokenizes anew)
RUNNING = ("kvmix:num_requests_running", "llamacpp:requests_processing",
           "vllm:num_requests_running")  # /metrics gauges


@dataclass
class LoadtestConfig:
    url: str | None = None  # a running server; else one server per method and baseline
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2", "pnmix1"])
    baselines: list[str] = field(default_factory=lambda: [ANCHOR])
    model: str = "smollm2"
    memory: str = "180MB"
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    requests: list[int] = field(default_factory=lambda: [64])  # per level (one: every level)
    prompt_tokens: int = 512
    new_tokens: list[int] = field(default_factory=lambda: [128])  # a request's, in turn
    temperature: float = 0.0  # 0: greedy
    data: str = "prose"
    backend: str = "auto"
    max_batch_tokens: int = 2048
    request_timeout: float = 3600.0  # seconds a request may take, waiting included
    vllm_python: str = vllm_server.DEFAULT_PYTHON  # the vLLM environment's, for vllm: rows
    out: str | None = None


def add_parser(commands) -> None:
    parser = commands.add_parser("loadtest", help="requests/s, tokens/s, latency under load")
    defaults = LoadtestConfig()
    parser.add_argument("--url", default=None,
                        help="a running server to load (else one server per method and "
                             "baseline, started here)")
    parser.add_argument("--methods", default=",".join(defaults.methods),
                        help="kvmix methods, each served by kvmix serve")
    parser.add_argument("--baselines", default=",".join(defaults.baselines),
                        help=f"other servers beside: '{ANCHOR}' (its own paged float cache), "
                             "llama.cpp:TYPE or llama.cpp:K/V (llama-server, e.g. llama.cpp:f16), "
                             "vllm:METHOD or vllm:auto (vLLM's server, with kvmix's plugin or "
                             "its own cache); '' for none")
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder; a .gguf "
                             "for llama.cpp rows")
    parser.add_argument("--memory", default=defaults.memory, help="every server's KV budget")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="concurrent clients of each level, e.g. 1,8,32")
    parser.add_argument("--requests", default="64", help="per level, or one per level")
    add_renamed(parser, "--prompt-tokens", "--prompt", type=int,
                default=defaults.prompt_tokens, help="prompt tokens of each request")
    add_renamed(parser, "--new-tokens", "--tokens", default="128",
                help="generated tokens of each request; several (64,128,256): in turn")
    parser.add_argument("--temperature", type=float, default=defaults.temperature,
                        help="sampling temperature of every request (0: greedy)")
    parser.add_argument("--data", default=defaults.data, help="prose, code or a text file")
    parser.add_argument("--backend", default=defaults.backend,
                        help=f"kvmix serve's --backend: {BACKEND_HELP}")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                        help="kvmix serve's --max-batch-tokens: tokens of one forward")
    add_renamed(parser, "--request-timeout", "--timeout", type=float,
                default=defaults.request_timeout,
                help="seconds a request may take, waiting included (then it counts as failed)")
    parser.add_argument("--vllm-python", default=defaults.vllm_python,
                        help="the vLLM environment's interpreter (make vllm), for vllm: rows")
    parser.add_argument("--out", default=None, help="folder for results.json and plots")
    parser.set_defaults(run=lambda args: run_loadtest(config_from(LoadtestConfig, args)))


def run_loadtest(config: LoadtestConfig) -> list[dict]:
    config = _moved_baselines(config)
    counts = _counts(config)
    from kvmix.models.loading import load_tokenizer

    tokenizer = load_tokenizer(config.model)
    texts = [tokenizer.decode(ids) for ids in prompt_set(config.data, tokenizer, max(counts),
                                                         config.prompt_tokens)]
    plans = _slot_plans(config, tokenizer, texts)
    rows = []
    for method in [None] if config.url else [*config.methods, *config.baselines]:
        try:
            with _server(config, method, plans.get(method)) as (url, facts):
                for concurrency, count in zip(config.concurrency, counts, strict=True):
                    outcomes, wall, peaks = asyncio.run(run_level(
                        url, texts[:count], config.new_tokens, concurrency,
                        config.request_timeout, config.temperature))
                    rows.append(_row(method or config.url, concurrency, outcomes, wall, peaks,
                                     facts))
                    console.print(f"{rows[-1]['method']} · concurrency {concurrency}: "
                                  f"{rows[-1]['output_tokens_per_s']:.1f} output tok/s, "
                                  f"{rows[-1]['failures']} failed")
        except (EngineMissing, vllm_server.VllmMissing) as error:
            console.print(f"[red]{method}: {error}[/red]")
            rows.append({"method": method, "error": str(error)})
    title = (f"kvmix loadtest · {config.model} · {config.memory} · {config.prompt_tokens} + "
             f"{_tokens(config)} tokens · temperature {config.temperature:g}")
    print_table(title, rows, COLUMNS)
    if config.out:
        _write(config, rows, title)
    return rows


def _row(method: str, concurrency: int, outcomes: list, wall: float, peaks: dict[str, float],
         facts: dict) -> dict:
    """One level's figures: the client's summary, the server's peaks and what the server is."""
    cache = facts.get("cache_bytes") or peaks.get("kvmix:cache_peak_bytes", 0)
    return {"method": method, "concurrency": concurrency, **summary(outcomes, wall),
            "peak_running": max((peaks[name] for name in RUNNING if name in peaks),
                                default=None),
            "peak_cache_mb": cache / 1e6 if cache else None, **facts,
            "errors": sorted({o.error for o in outcomes if o.error})[:5]}


def _resolved(method: str | None) -> str | None:
    """The method with every parameter, as the server runs it."""
    if method is None:
        return None
    if method == ANCHOR:
        return "transformers' ContinuousBatchingManager and PagedAttentionCache (SDPA, page 256)"
    return repr(parse_method(method))


def _slot_plans(config: LoadtestConfig, tokenizer, texts: list[str]
                ) -> dict[str, SlotFit]:
    """Each llama.cpp row's slots within ``--memory``, each request counted as llama.cpp
    tokenizes the prompt text again (with its BOS) plus the most output tokens; ValueError
    before any server starts when no slot fits."""
    from kvmix.models.loading import load_config

    engines = [] if config.url else engine_rows(config.baselines, LLAMA_PREFIX)
    if not engines:
        return {}
    model_config, _ = load_config(config.model)
    prompt = max(len(tokenizer(text, add_special_tokens=False).input_ids) for text in texts)
    per_request = prompt + 1 + max(config.new_tokens)
    return {m: fit_slots(model_config, *parse_types(m),
                                   parse_memory(config.memory), per_request,
                                   max(config.concurrency)) for m in engines}


def _counts(config: LoadtestConfig) -> list[int]:
    counts = config.requests * len(config.concurrency) if len(config.requests) == 1 \
        else config.requests
    if len(counts) != len(config.concurrency):
        raise ValueError(f"requests={config.requests} must be one count or one per "
                         f"concurrency level ({len(config.concurrency)})")
    for name, values in (("concurrency", config.concurrency), ("requests", counts),
                         ("prompt_tokens", [config.prompt_tokens]),
                         ("new_tokens", config.new_tokens)):
        if not values or any(not isinstance(v, int) or v < 1 for v in values):
            raise ValueError(f"{name}={values} is invalid; expected integers >= 1")
    if not 0 <= config.temperature <= 2:
        raise ValueError(f"temperature={config.temperature} is invalid; expected 0 to 2")
    _check_servers(config)
    engines = [] if config.url else engine_rows(config.baselines, LLAMA_PREFIX)
    for method in engines:
        parse_types(method)
    for method in [] if config.url else engine_rows(config.baselines, vllm_server.PREFIX):
        vllm_server.parse(method)
    if engines:
        from kvmix.models.loading import gguf_path

        parse_memory(config.memory)
        gguf_path(config.model)
    return counts


def _moved_baselines(config: LoadtestConfig) -> LoadtestConfig:
    """Baselines given among the methods (the spelling before ``--baselines``) moved there, with
    a warning; named only there, they are the baselines (as before, no default one added)."""
    moved = [m for m in config.methods if _baseline(m)]
    if not moved:
        return config
    warn_renamed(f"baselines in --methods ({','.join(moved)})", f"--baselines {','.join(moved)}")
    given = config.baselines != LoadtestConfig().baselines
    baselines = list(dict.fromkeys([*config.baselines, *moved])) if given else moved
    return replace(config, methods=[m for m in config.methods if m not in moved],
                   baselines=baselines)


def _baseline(name: str) -> bool:
    return name == ANCHOR or name.startswith((LLAMA_PREFIX, vllm_server.PREFIX))


def _check_servers(config: LoadtestConfig) -> None:
    """Every method a kvmix method, every baseline a server loadtest can start."""
    if config.url:
        return
    unknown = [b for b in config.baselines if not _baseline(b)]
    if unknown:
        raise ValueError(f"baselines {unknown} are unknown; valid: {ANCHOR}, llama.cpp:TYPE, "
                         "vllm:METHOD")
    for method in config.methods:
        parse_method(method)


def _tokens(config: LoadtestConfig) -> str:
    return "/".join(map(str, config.new_tokens))


@contextlib.contextmanager
def _server(config: LoadtestConfig, method: str | None, plan: SlotFit | None):
    """The server a row measures, until the block ends -> (its URL, what the row records about
    it): the given URL, llama-server for a llama.cpp row, else ``kvmix serve``."""
    if method is None:
        yield config.url, {}
    elif plan is not None:
        import torch

        from kvmix.models.loading import gguf_path

        with _log_folder(config) as folder:
            server = LlamaServer(gguf_path(config.model), plan,
                                          torch.get_num_threads(),
                                          folder / f"{method.replace('/', '-')}.log")
            with server as url:
                yield url, {"startup_s": server.startup_s, "slots": plan.slots,
                            "cache_bytes": server.reported_bytes,
                            "planned_cache_bytes": plan.bytes,
                            "cpu_variant": server.cpu_variant,
                            "resolved": " ".join(server.command(0)[1:]),
                            "engine": server_version()}
    elif method.startswith(vllm_server.PREFIX):
        from kvmix.models.loading import model_folder

        with _log_folder(config) as folder:
            server = vllm_server.VllmServer(
                config.vllm_python, model_folder(config.model), method,
                int(parse_memory(config.memory)),
                config.prompt_tokens + max(config.new_tokens) + SLACK,
                folder / f"{method.replace(':', '-').replace('/', '-')}.log",
                sequences=max(config.concurrency))  # as many as the clients keep running
            with server as url:
                # vLLM reports the tokens its cache holds, not its bytes: the budget it was given
                # is a setting, not a figure of this row
                yield url, {"startup_s": server.startup_s,
                            "kv_cache_memory_bytes": server.memory,
                            "staging_bytes": server.staging,
                            "max_num_seqs": server.sequences,
                            "cache_tokens": server.reported_tokens,
                            "resolved": " ".join(server.command(0)[1:]),
                            "engine": server.version()}
    else:
        server = _kvmix_server(config, method)
        with server as url:
            yield url, {"startup_s": server.startup_s, "resolved": _resolved(method)}


@contextlib.contextmanager
def _log_folder(config: LoadtestConfig):
    """Where an engine's server log goes: ``--out``/logs, else a folder removed afterwards."""
    if config.out:
        yield Path(config.out) / "logs"
    else:
        with tempfile.TemporaryDirectory(prefix="kvmix-engine-") as folder:
            yield Path(folder)


class _kvmix_server(LocalServer):
    """``kvmix serve`` for ``method``, as the loadtest configures every server."""

    def __init__(self, config: LoadtestConfig, method: str):
        super().__init__()
        self.config, self.method = config, method
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def command(self, port: int) -> list[str]:
        c = self.config
        return [sys.executable, "-m", "kvmix.cli", "serve", "--model", c.model, "--method",
                self.method, "--memory", c.memory, "--port", str(port), "--backend", c.backend,
                "--max-tokens", str(max(c.new_tokens)), "--max-batch-tokens",
                str(c.max_batch_tokens), "--fit-prompt", str(c.prompt_tokens)]

    def __enter__(self) -> str:
        try:
            return super().__enter__()
        except ServerDown as error:
            raise ValueError(f"kvmix serve --method {self.method} did not start ({error})") \
                from None


def _write(config: LoadtestConfig, rows: list[dict], title: str) -> None:
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    plots = []
    for key, label, name in (("output_tokens_per_s", "output tokens/s", "throughput.png"),
                             ("ttft_p50_s", "time to first token p50 (s)", "ttft.png")):
        series = {}
        for row in rows:
            if "error" not in row:
                series.setdefault(row["method"], []).append((row["concurrency"], row[key]))
        plots.append(str(scatter_lines(out / name, series, "concurrent clients", label,
                                       f"{config.model} · {config.memory} KV · "
                                       f"{config.prompt_tokens} + {_tokens(config)} tokens")))
    path = write_results(out, "loadtest", config, rows, (title, COLUMNS), plots=plots,
                         client={name: version(name) for name in ("httpx", "fastapi", "uvicorn",
                                                                    "openai", "llama_cpp_python")})
    console.print(f"wrote {path}")
