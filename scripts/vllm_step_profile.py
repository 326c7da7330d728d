"""Where a decode step's time goes inside vLLM's offline engine, kvmix's plugin against vLLM's
own cache, at the same batch: ``ROWS`` random 128-token prompts decoded together with every row
running (the budget holds them all), the engine core in this process. Per decode-only step
(every row one token), milliseconds split into:

* model: the model's forward less its attention layers (vLLM's linear layers, norms, RoPE);
* attention: the attention layers' ``forward`` (kvmix: ``KvmixImpl``), of which kvmix's op
  (``kvmix::step`` through ``cpu.call``: the step's seals encoded into their pages, the fused
  CPU kernel, the staging) is counted apart from the Python and torch ops around it;
* plan: the attention metadata builder (kvmix: ``Planner.plan``, once for every layer);
* vLLM: the rest of the engine's step (scheduling, input preparation, sampling, outputs).

In the vLLM environment, for each setting (``fp8`` and ``auto`` are vLLM's own caches; the
first is the baseline of the ratios; a method may carry the plugin's other settings after an
``@``: ``pnmix1@values=token``), one engine a process, settings in turn:

    .venv-vllm/bin/python scripts/vllm_step_profile.py MODEL_DIR fp8 kivi2 pnmix1:group=32 \
        [--out DIR]

``--out``: DIR/results.json with the table (run it again into DIR/1, DIR/2, ... and
``kvmix report`` shows each figure as median (min-max) over the repeats).

MODEL_DIR: a float model folder (``kvmix.engines.vllm.scoring.float_folder`` writes one).
``ROWS`` (24), ``PROMPT`` (128) and ``TOKENS`` (256, decode steps: the first 32 are skipped)
come from the environment, and ``SPREAD`` (0): row i's prompt is ``PROMPT + i · SPREAD // ROWS``
tokens, so that rows fill and seal their groups in different steps, as requests that came at
different times do (with equal prompts every row seals in the same step).

``OP_PARTS=1`` also splits kvmix's op by part (``kvmix.runtime.kernels.cpu.timings``: setup,
keys and values of float segments and of packed blocks, softmax, merge, staging, seal; µs a
layer, summed over the op's threads): its time stamps make the op itself a little slower."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

ROWS = int(os.environ.get("ROWS", 24))
PROMPT = int(os.environ.get("PROMPT", 128))
TOKENS = int(os.environ.get("TOKENS", 256))
SPREAD = int(os.environ.get("SPREAD", 0))
OP_PARTS = os.environ.get("OP_PARTS", "0") not in ("", "0")
if OP_PARTS:
    os.environ["KVMIX_OP_TIMING"] = "1"  # read when the op loads
SKIP = 32  # decode steps before the ones counted (warm caches, steady batch)
PARTS = ("model", "attention", "op", "plan", "vLLM")


class Clock:
    """Seconds spent inside wrapped callables, per name, for the step being run."""

    def __init__(self):
        self.now: dict[str, float] = defaultdict(float)
        self.depth: dict[str, int] = defaultdict(int)
        self.decode = False  # the step's plan had one token a row

    def wrap(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)
        setattr(owner, name, lambda *args, **kwargs: self.timed(part, inner, *args, **kwargs))

    def wrap_op(self, cpu, ops: tuple[str, ...]) -> None:
        """kvmix's calls of ``ops`` through ``cpu.call`` (every call of its op library), timed
        as "op"."""
        call, timed = cpu.call, self.timed

        def call_timed(op, *args, **kwargs):
            return (timed("op", call, op, *args, **kwargs) if op in ops
                    else call(op, *args, **kwargs))

        cpu.call = call_timed

    def timed(self, part: str, inner, *args, **kwargs):
        self.depth[part] += 1
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            self.depth[part] -= 1
            if not self.depth[part]:  # nested calls (a layer inside a model) once
                self.now[part] += time.perf_counter() - start

    @contextmanager
    def step(self, op_parts: bool = False):
        self.now.clear()
        start = time.perf_counter()
        yield
        self.now["step"] = time.perf_counter() - start
        if op_parts:  # the op's parts in this step: µs summed over its calls and threads
            from kvmix.runtime.kernels import cpu

            for name, spent in cpu.timings().items():
                self.now[f"op.{name}"] = spent


def instrument(clock: Clock, setting: str) -> None:
    from vllm.model_executor.models.llama import LlamaForCausalLM

    clock.wrap(LlamaForCausalLM, "forward", "forward")
    if setting in ("auto", "fp8"):
        from vllm.v1.attention.backends import cpu_attn

        clock.wrap(cpu_attn.CPUAttentionBackendImpl, "forward", "attention")
        builder = cpu_attn.CPUAttentionMetadataBuilder
    else:
        from kvmix.runtime.kernels import cpu
        from kvmix.vllm import backend

        cpu.load()
        clock.wrap(backend.KvmixImpl, "forward", "attention")
        clock.wrap_op(cpu, ("step", "decode_batch"))  # a layer's seals, attention, staging
        builder = backend.KvmixMetadataBuilder
    build = builder.build

    def build_and_mark(self, common_prefix_len, meta, *args, **kwargs):
        clock.decode = meta.num_actual_tokens == meta.num_reqs
        return build(self, common_prefix_len, meta, *args, **kwargs)

    builder.build = build_and_mark
    clock.wrap(builder, "build", "plan")


def profile(model: str, setting: str) -> dict[str, float]:
    import torch
    from vllm import LLM, SamplingParams

    clock = Clock()
    instrument(clock, setting)
    if setting in ("auto", "fp8"):
        cache = {"kv_cache_dtype": setting}
    else:  # a method, and the plugin's other settings after an @ (pnmix1@values=token)
        from kvmix.runtime.plugin_settings import split

        method, plugin = split(setting)
        cache = {"additional_config": {"kvmix": {"method": method, **plugin}}}
    llm = LLM(model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=PROMPT + SPREAD + TOKENS + 1, max_num_seqs=ROWS, seed=0,
              # every row's tokens in float32 on the default model (30 layers, 3 KV heads of 64)
              kv_cache_memory_bytes=4 * ROWS * (PROMPT + SPREAD + TOKENS) * 2 * 30 * 3 * 64
              + (64 << 20),
              **cache)
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(100, 40000, (PROMPT + i * SPREAD // ROWS,),
                                                  generator=g).tolist()} for i in range(ROWS)]
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True, temperature=0)
    engine = llm.llm_engine
    for index, prompt in enumerate(prompts):
        engine.add_request(str(index), prompt, params)
    steps, decodes = [], 0
    while engine.has_unfinished_requests():
        with clock.step(OP_PARTS and setting not in ("auto", "fp8")):
            engine.step()
        if clock.decode and clock.now["plan"]:
            decodes += 1
            if SKIP < decodes < TOKENS - 1:
                steps.append(dict(clock.now))
    if not steps:
        raise SystemExit(f"no decode step counted: TOKENS={TOKENS} must exceed {SKIP + 2}")
    mean = {key: 1e3 * sum(s.get(key, 0.0) for s in steps) / len(steps)
            for key in ("step", "forward", "attention", "op", "plan")}
    parts = {"model": mean["forward"] - mean["attention"],
             "attention": mean["attention"] - mean["op"], "op": mean["op"], "plan": mean["plan"],
             "vLLM": mean["step"] - mean["forward"] - mean["plan"], "step": mean["step"]}
    print(f"{setting:>18} x{ROWS} ({len(steps)} decode steps, context {PROMPT + SKIP}.."
          f"{PROMPT + SPREAD + TOKENS}): " + ", ".join(f"{key} {parts[key]:.1f}" for key in
                                                (*PARTS, "step")) + " ms", flush=True)
    split = {key: sum(s[key] for s in steps) / len(steps) for key in steps[0]
             if key.startswith("op.")}
    if split:  # µs a layer: a step's sum over its calls (one a layer)
        calls = split.pop("op.calls")
        parts.update({key: value / calls for key, value in split.items()})
        print(f"{setting:>18} op by part, µs a layer (threads summed): " + ", ".join(
            f"{key[3:]} {value / calls:.1f}" for key, value in split.items()), flush=True)
    print("RESULT " + json.dumps({"setting": setting, "steps": len(steps), **parts}), flush=True)
    return parts


COLUMNS = {"setting": "setting", "model": "model ms", "attention": "attention ms (less op)",
           "op": "op ms", "plan": "plan ms", "vLLM": "vLLM ms", "step": "step ms",
           "kvmix": "attention+op+plan ms", "step_ratio": "step / first's"}
OP_COLUMNS = {"setting": "setting", "op": "op ms a step", **{
    f"op.{part}": f"{part} µs" for part in ("setup", "start", "keys_float", "keys_packed",
                                           "softmax", "values_float", "values_packed", "merge",
                                           "stage", "seal", "wall")}}


def main(argv: list[str]) -> None:
    out = argv.index("--out") if "--out" in argv else None
    folder = None if out is None else argv[out + 1]
    model, *settings = argv[: out] if out is not None else argv
    if len(settings) == 1 and folder is None:
        profile(model, settings[0])
        return
    rows = []
    for setting in settings:  # one engine a process
        done = subprocess.run([sys.executable, __file__, model, setting], check=True,
                              capture_output=True, text=True)
        lines = done.stdout.splitlines()
        rows.append(json.loads(next(x for x in lines if x.startswith("RESULT "))[7:]))
        for line in lines:
            if f" x{ROWS} (" in line or " op by part" in line:
                print(line, flush=True)
    for row in rows:
        row["kvmix"] = row["attention"] + row["op"] + row["plan"]
        row["step_ratio"] = row["step"] / rows[0]["step"]
    if folder:
        from kvmix.jobs import report

        report.invocation = ["python", "scripts/vllm_step_profile.py", *argv]
        prompts = f"{PROMPT}" + (f" to {PROMPT + (ROWS - 1) * SPREAD // ROWS}" if SPREAD else "")
        title = (f"A decode step inside vLLM's offline engine, ms · {ROWS} rows of {prompts} + "
                 f"{TOKENS} tokens, every row running")
        if OP_PARTS:
            title = (f"kvmix's op by part inside vLLM, µs a layer (the parts summed over the op's "
                     f"threads; wall: the call) · {ROWS} rows of {prompts} + {TOKENS} tokens")
        report.write_results(folder, "vllm_step_profile",
                             {"rows": ROWS, "prompt": PROMPT, "spread": SPREAD, "tokens": TOKENS,
                              "skip": SKIP,
                              "op_parts": OP_PARTS, "model": model, "settings": settings}, rows,
                             (title, OP_COLUMNS if OP_PARTS else COLUMNS))


if __name__ == "__main__":
    main(sys.argv[1:])
