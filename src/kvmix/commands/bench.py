"""``kvmix bench``: decode speed and memory of each method beside the caches users would pick
instead, measured side by side in one run.

For every prompt length: prefill every cache, then time greedy single-token decode steps over
them in interleaved rounds (``--rounds``; the median round counts), so that a busy machine slows
every cache alike:
transformers' ``DynamicCache`` (``dynamic``) and ``QuantizedCache`` (``quanto2``, ``quanto4``,
``hqq2``, ``hqq4``), llama.cpp's own decode through its Python bindings on the same GGUF
(``llama.cpp:TYPE`` or ``llama.cpp:K/V``, flash attention, the same threads; one build for
any x86 CPU, ``kvmix.engines.llamacpp.build``), then every kvmix method on every backend.
``vs_dynamic`` is tokens/s over DynamicCache's at the same prompt in the same run. Memory is
the allocator's bytes in use (``kvmix.bench.resources``): ``steady_bytes`` held after
prefill and warmup above those in use just before the cache was made, ``peak_bytes`` that plus
the largest rise while decoding (what a step materialises: a float history, a concatenation);
``nbytes`` is what the cache itself reports (for transformers' caches, the storages reachable
from them; for llama.cpp, the cache it allocates, sized once for the longest
``--prompt-tokens`` as a server sizes a slot). llama.cpp's memory deltas count all it takes
from the heap once it starts loading (context, compute buffers, weights it copies out of the
mapped file), so only its ``nbytes`` compares with the caches'; it runs the GGUF's own quantized
weights in C where kvmix runs them dequantized through transformers.
``select_s`` is the prefill time spent in channel selection (PN-Mix, Kitty, ChanMix).

``--shape HEADS,KV_HEADS,HEAD_DIM`` times the attention op alone instead, on synthetic caches
already holding ``--context`` tokens (random keys and values, no prompt) for ``--batch``
sequences, beside float SDPA and the float variant of the same kernels
(``kvmix.bench.opbench``); no model is loaded.

``--throughput`` measures many sequences at once (``kvmix.bench.throughput``): aggregate
decode tokens/s at each ``--batch``, and at each cache's largest batch within ``--memory`` at
``--prompt-tokens`` + ``--budget-tokens`` tokens per sequence (equal memory), beside
DynamicCache.
Timings are wall-clock on this machine; they belong here, never in pass/fail tests.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from rich.progress import Progress

from kvmix.bench import opbench, throughput
from kvmix.bench.resources import PeakMemory, heap_bytes, synchronize
from kvmix.capacity import parse_memory
from kvmix.commands.args import add_job_arguments, add_renamed, config_from
from kvmix.core.memory import reachable_bytes
from kvmix.engines.llamacpp.build import EngineMissing, bindings
from kvmix.engines.llamacpp.decoder import Decoder
from kvmix.engines.llamacpp.slots import PREFIX as LLAMA_PREFIX
from kvmix.engines.llamacpp.slots import parse_types
from kvmix.engines.rows import engine_rows
from kvmix.evaluation.data import load_text
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.jobs.plots import scatter_lines
from kvmix.jobs.report import console, finish, print_table, write_results
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel, gguf_path, resolve_dtype
from kvmix.runtime.attention import make_cache
from kvmix.runtime.baselines import BASELINES, transformers_cache
from kvmix.runtime.folding import prepare_model
from kvmix.runtime.kernels import BACKENDS, cpu, resolve

COLUMNS = {"method": "method", "backend": "backend", "prompt": "prompt",
           "prefill_s": "prefill s", "select_s": "select s", "tokens_per_s": "tokens/s",
           "vs_dynamic": "vs dynamic", "ms_per_token": "ms/token", "nbytes": "cache bytes",
           "peak_bytes": "peak Δ", "steady_bytes": "steady Δ"}
THROUGHPUT_COLUMNS = {"method": "method", "backend": "backend", "group": "group",
                      "batch": "batch", "tokens_per_s": "tokens/s", "vs_dynamic": "vs dynamic",
                      "max_batch": "max batch", "per_sequence_bytes": "bytes/seq",
                      "cache_bytes": "cache bytes", "peak_bytes": "peak Δ",
                      "prefill_s": "prefill s"}
OP_COLUMNS = {"method": "method", "backend": "backend", "context": "context", "batch": "batch",
              "us_per_step": "µs/layer-step", "host_us_per_step": "host µs", "gb_per_s": "GB/s",
              "limit_us": "µs at copy bandwidth", "of_limit": "of limit", "vs_sdpa": "vs SDPA",
              "vs_float_kernel": "vs float kernel", "nbytes": "cache bytes",
              "encode_us": "encode µs/block"}


@dataclass
class BenchConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: ["full", "kivi2"])
    baselines: list[str] = field(default_factory=lambda: ["dynamic"])
    prompt_tokens: list[int] = field(default_factory=lambda: [1024])
    new_tokens: int = 32
    warmup: int = 4
    rounds: int = 4
    backend: list[str] = field(default_factory=lambda: ["auto"])
    shape: str | None = None
    context: list[int] = field(default_factory=lambda: [16384])
    batch: list[int] = field(default_factory=lambda: [1])
    throughput: bool = False
    memory: str = "2GB"
    budget_tokens: int = 256  # --throughput: generated tokens per sequence --memory must hold


def add_parser(commands) -> None:
    parser = commands.add_parser("bench", help="decode speed and memory vs transformers' caches")
    add_job_arguments(parser, BenchConfig(), backend=False)
    parser.add_argument("--baselines", default="dynamic",
                        help=f"caches to run beside: transformers' ({', '.join(BASELINES)}), "
                             "llama.cpp:TYPE or llama.cpp:K/V (e.g. llama.cpp:q4_0); '' for "
                             "none")
    add_renamed(parser, "--prompt-tokens", "--prompt", default="1024",
                help="prompt lengths, e.g. 1024,7680 (each prefilled, then decoded from)")
    parser.add_argument("--new-tokens", type=int, default=BenchConfig.new_tokens,
                        help="generated tokens timed: greedy decode steps per cache")
    parser.add_argument("--warmup", type=int, default=BenchConfig.warmup,
                        help="untimed decode steps after the prefill")
    parser.add_argument("--rounds", type=int, default=BenchConfig.rounds,
                        help="timing rounds; every cache decodes new_tokens/rounds per round")
    parser.add_argument("--backend", default="auto",
                        help=f"kvmix backends to run, e.g. torch,cpu ({', '.join(BACKENDS)})")
    parser.add_argument("--shape", default=None,
                        help="HEADS,KV_HEADS,HEAD_DIM: time the attention op alone on synthetic "
                             "caches of this shape (e.g. 32,8,128), no model")
    parser.add_argument("--context", default="16384",
                        help="--shape: tokens already in each synthetic cache (random keys and "
                             "values, no prompt), e.g. 16384,65536")
    parser.add_argument("--batch", default="1",
                        help="--shape, --throughput: sequences, e.g. 1,4,16")
    parser.add_argument("--throughput", action="store_true",
                        help="aggregate decode tokens/s of many sequences, at each --batch and "
                             "at each cache's largest batch within --memory")
    parser.add_argument("--memory", default=BenchConfig.memory,
                        help="--throughput: the cache budget, e.g. 2GB or 512MiB")
    add_renamed(parser, "--budget-tokens", "--tokens", type=int,
                default=BenchConfig.budget_tokens,
                help="--throughput: generated tokens per sequence that --memory must hold after "
                     "--prompt-tokens (sizes each cache's largest batch; --new-tokens are timed)")
    parser.set_defaults(run=lambda args: run_bench(config_from(BenchConfig, args)))


def run_bench(config: BenchConfig, loaded: LoadedModel | None = None) -> list[dict]:
    _check(config)
    if config.shape:
        return _run_shape(config)
    if config.throughput:
        return _run_throughput(config, loaded)
    engines = _engines(config)
    loaded, ids = load_inputs(config, max(config.prompt_tokens), loaded)
    backends = list(dict.fromkeys(resolve(b, loaded.model.device) for b in config.backend))
    builds = [(b, "-", partial(_baseline, b)) for b in config.baselines if b not in engines]
    builds += [(b, "-", partial(_engine, b, config)) for b in engines]
    builds += [(m, b, partial(_kvmix, m, b)) for m in config.methods for b in backends]
    rows = []
    with Progress(console=console, transient=True) as bar:
        for prompt in config.prompt_tokens:
            task = bar.add_task(f"prompt {prompt}", total=len(builds) * (1 + config.rounds))
            runs = []
            for name, backend, build in builds:
                runs.append(_start(loaded.model, ids[:, :prompt], name, backend, build, config))
                bar.advance(task)
            steps = -(-config.new_tokens // config.rounds)
            for _ in range(config.rounds):  # interleaved: drift of the machine hits all alike
                for run in runs:
                    throughput.timed(run, steps)
                    bar.advance(task)
            for run in runs:
                _measure_memory(run, min(steps, 4))
            rows += [run.row(prompt) for run in runs]
            del runs
    _ratios(rows)
    plots = [str(_plot(config, rows))] if config.out else []
    finish("bench", config, loaded, rows, f"{loaded.model.device} · {config.rounds} rounds of "
           f"{-(-config.new_tokens // config.rounds)} decode steps · {torch.get_num_threads()} "
           "threads", COLUMNS, device=str(loaded.model.device),
           threads=torch.get_num_threads(), plots=plots, cpu_kernels=_kernels(backends))
    return rows


def _kernels(backends: list[str]) -> str | None:
    """Which CPU kernels ran (printed, and kept in results.json), when the CPU op did."""
    if "cpu" not in backends:
        return None
    kernels = cpu.describe()
    console.print(f"CPU decode op: {kernels}")
    return kernels


def _run_shape(config: BenchConfig) -> list[dict]:
    shape, device = opbench.Shape.parse(config.shape), torch.device(config.device)
    backends = list(dict.fromkeys(resolve(b, device) for b in config.backend))
    dtype = resolve_dtype(config.dtype, device.type)
    steps = -(-config.new_tokens // config.rounds)
    rows = [row for backend in backends for row in opbench.run(
        shape, config.methods, backend, config.context, config.batch, dtype, device, steps,
        config.rounds)]
    name = f"synthetic {shape.heads}q/{shape.kv_heads}kv×{shape.head_dim}"
    info = {"name": name, "dtype": str(dtype).removeprefix("torch."), "shape": vars(shape)}
    title = (f"kvmix bench · {name} · {device} · {dtype} · {config.rounds} rounds of "
             f"{steps} layer-steps")
    print_table(title, rows, OP_COLUMNS)
    kernels = _kernels(backends)
    if config.out:
        path = write_results(config.out, "bench", config, rows, (title, OP_COLUMNS),
                             model=info, device=str(device),
                             gpu=torch.cuda.get_device_name(device) if device.type == "cuda"
                             else None, threads=torch.get_num_threads(), cpu_kernels=kernels)
        console.print(f"wrote {path}")
    return rows


def _run_throughput(config: BenchConfig, loaded: LoadedModel | None) -> list[dict]:
    prompt, total = config.prompt_tokens[0], config.prompt_tokens[0] + config.budget_tokens
    loaded, _ = load_inputs(config, total, loaded)
    ids = loaded.tokenizer(load_text(config.data), return_tensors="pt",
                           add_special_tokens=False).input_ids  # [1, N]: every window's source
    backends = list(dict.fromkeys(resolve(b, loaded.model.device) for b in config.backend))
    caches = [throughput.baseline_cache(b) for b in config.baselines]
    caches += [throughput.kvmix_cache(m, b) for m in config.methods for b in backends]
    memory = parse_memory(config.memory)
    throughput.measure_sizes(loaded.model, caches, ids[:, :total], total, memory)
    groups = [("batch", {c.name + c.backend: b for c in caches}) for b in config.batch]
    groups.append(("budget", {c.name + c.backend: c.max_batch for c in caches}))
    steps = -(-config.new_tokens // config.rounds)
    rows = []
    with Progress(console=console, transient=True) as bar:
        for group, batches in groups:
            task = bar.add_task(group, total=len(caches) * (1 + config.rounds))
            runs = []
            for cache in caches:
                batch = batches[cache.name + cache.backend]
                if batch > 0:
                    runs.append(throughput.start(loaded.model, cache, group, batch,
                                                 throughput.windows(ids, batch, prompt), total,
                                                 config.warmup))
                bar.advance(task)
            for _ in range(config.rounds):  # interleaved: drift of the machine hits all alike
                for run in runs:
                    throughput.timed(run, steps)
                    bar.advance(task, len(caches) / max(len(runs), 1))
            for run in runs:
                throughput.measure_peak(run, min(steps, 2))
            rows += throughput.rows(runs, prompt)
            del runs
    plots = [str(_throughput_plot(config, rows))] if config.out else []
    finish("bench", config, loaded, rows, f"throughput · {config.memory} for {prompt} + "
           f"{config.budget_tokens} tokens · {config.rounds} rounds of {steps} steps · "
           f"{torch.get_num_threads()} threads", THROUGHPUT_COLUMNS,
           device=str(loaded.model.device), threads=torch.get_num_threads(), plots=plots)
    return rows


def _check(config: BenchConfig) -> None:
    """Bad input fails before the model loads."""
    for name, least in (("new_tokens", 1), ("warmup", 0), ("rounds", 1)):
        if getattr(config, name) < least:
            raise ValueError(f"{name}={getattr(config, name)} is invalid; expected >= {least}")
    for name in ("prompt_tokens", "context", "batch"):
        if not getattr(config, name) or min(getattr(config, name)) < 1:
            raise ValueError(f"{name}={getattr(config, name)} is invalid; expected values >= 1")
    if config.shape:
        opbench.Shape.parse(config.shape)
    if config.throughput:
        parse_memory(config.memory)
        if config.budget_tokens < 0 or len(config.prompt_tokens) != 1:
            raise ValueError(f"--throughput takes one prompt length and budget_tokens >= 0; "
                             f"got prompt_tokens={config.prompt_tokens}, "
                             f"budget_tokens={config.budget_tokens}")
    engines = engine_rows(config.baselines, LLAMA_PREFIX)
    unknown = sorted(set(config.baselines) - set(BASELINES) - set(engines))
    if unknown:
        raise ValueError(f"baselines {unknown} are unknown; valid: {', '.join(BASELINES)}, "
                         "llama.cpp:TYPE")
    for engine in engines:
        parse_types(engine)
    if engines and (config.shape or config.throughput):
        raise ValueError(f"baselines {engines}: llama.cpp decodes in the per-prompt bench, not "
                         "with --shape or --throughput (kvmix loadtest serves it under load)")
    if engines:
        gguf_path(config.model)
    for backend in config.backend:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is invalid; valid: {', '.join(BACKENDS)}")
    for method in config.methods:
        parse_method(method)


@dataclass
class _Run:
    """One cache under test at one prompt length, kept alive across the timing rounds."""

    name: str
    backend: str
    model: Any
    cache: Any
    token: torch.Tensor  # [1, 1] the next input
    prefill_s: float
    select_s: float
    steady_bytes: int  # allocator bytes held after prefill and warmup, above the start
    seconds: list[float] = field(default_factory=list)  # per round, per decode step
    transient: int = 0  # largest rise above the window's start while decoding

    def row(self, prompt: int) -> dict:
        ms = 1000 * statistics.median(self.seconds)
        return {"method": self.name, "backend": self.backend, "prompt": prompt,
                "prefill_s": self.prefill_s, "select_s": self.select_s,
                "tokens_per_s": 1000 / ms, "ms_per_token": ms, "nbytes": _nbytes(self.cache),
                "peak_bytes": self.steady_bytes + self.transient,
                "steady_bytes": self.steady_bytes}


@torch.no_grad()
def _start(model, ids: torch.Tensor, name: str, backend: str, build: Callable,
           config: BenchConfig) -> _Run:
    """Make the cache, prefill ``ids`` [1, T] (timed) and warm up."""
    gc.collect()
    base = heap_bytes()
    runner, cache, selecting = build(model)
    start = time.perf_counter()
    logits = runner(ids.to(runner.device), cache=cache, use_cache=True, logits_to_keep=1).logits
    synchronize(runner.device)
    prefill = time.perf_counter() - start
    token = logits[:, -1:].argmax(-1)  # [1, 1]
    del logits
    for _ in range(config.warmup):
        token = throughput.step(runner, cache, token)
    gc.collect()
    return _Run(name, backend, runner, cache, token, prefill, selecting[0], heap_bytes() - base)


@torch.no_grad()
def _measure_memory(run: _Run, steps: int) -> None:
    """``steps`` decode steps, untimed, with the allocator sampled: the largest rise above the
    round's start is what one step materialises."""
    gc.collect()
    with PeakMemory() as memory:
        start_bytes = heap_bytes()
        for _ in range(steps):
            run.token = throughput.step(run.model, run.cache, run.token)
    run.transient = max(run.transient, memory.peak - start_bytes)


def _kvmix(method: str, backend: str, model) -> tuple[Any, Any, list[float]]:
    runner = prepare_model(model, method)
    cache = make_cache(runner, method, backend=backend)
    return runner, cache, _time_selection(cache.method)


def _engines(config: BenchConfig) -> list[str]:
    """The llama.cpp baselines that can run here; one whose bindings are missing is reported
    and left out, and the other rows still run."""
    engines = engine_rows(config.baselines, LLAMA_PREFIX)
    try:
        if engines:
            bindings()
    except EngineMissing as error:
        console.print(f"[red]{', '.join(engines)} left out: {error}[/red]")
        config.baselines = [b for b in config.baselines if b not in engines]
        return []
    return engines


def _engine(name: str, config: BenchConfig, model) -> tuple[Any, Any, list[float]]:
    """llama.cpp on the same GGUF with room for the longest prompt and every decode step."""
    steps = -(-config.new_tokens // config.rounds) * config.rounds + config.warmup + 8
    decoder = Decoder(gguf_path(config.model), model.config,
                               *parse_types(name), max(config.prompt_tokens) + steps,
                               torch.get_num_threads())
    return decoder, decoder, [0.0]


def _baseline(name: str, model) -> tuple[Any, Any, list[float]]:
    make_cache(model, "full")  # route through kvmix attention: plain SDPA for other caches
    return model, transformers_cache(name, model), [0.0]


def _time_selection(method) -> list[float]:
    """Wrap the method's prefill-time selection with a stopwatch: [seconds] accumulates."""
    spent = [0.0]
    select = method.select

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return select(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    method.select = timed
    return spent


def _nbytes(cache) -> int | None:
    if hasattr(cache, "nbytes"):
        return cache.nbytes()
    try:
        return reachable_bytes(cache)
    except (RuntimeError, NotImplementedError):  # tensor subclasses without plain storage
        return None


def _ratios(rows: list[dict]) -> None:
    dynamic = {r["prompt"]: r["tokens_per_s"] for r in rows if r["method"] == "dynamic"}
    for row in rows:
        reference = dynamic.get(row["prompt"])
        row["vs_dynamic"] = row["tokens_per_s"] / reference if reference else None


def _plot(config: BenchConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        label = row["method"] if row["backend"] == "-" else f"{row['method']} ({row['backend']})"
        series.setdefault(label, []).append((row["prompt"], row["ms_per_token"]))
    return scatter_lines(Path(config.out) / "decode.png", series, "prompt tokens",
                         "ms per decode step", "decode latency vs context")


def _throughput_plot(config: BenchConfig, rows: list[dict]) -> Path:
    Path(config.out).mkdir(parents=True, exist_ok=True)
    series: dict[str, list[tuple[float, float]]] = {}
    marks: dict[str, tuple[float, float]] = {}
    for row in rows:
        label = row["method"] if row["backend"] == "-" else f"{row['method']} ({row['backend']})"
        series.setdefault(label, []).append((row["batch"], row["tokens_per_s"]))
        if row["group"] == "budget":
            marks[label] = (row["batch"], row["tokens_per_s"])
    return scatter_lines(Path(config.out) / "throughput.png", series, "batch (sequences)",
                         "aggregate decode tokens/s",
                         f"throughput vs batch (★: largest batch within {config.memory})",
                         marks=marks)
