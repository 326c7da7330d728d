"""Perplexity through vLLM: ``python -m kvmix.vllm.score REQUEST.json OUT.json`` in the vLLM
environment, for ``kvmix compare --engine vllm``.

The request names a model folder, the token ids [n], the context, and the methods (``full``:
vLLM as shipped). Each method runs in an engine of its own (one after the other, in this
process) with chunked prefill over the packed cache; vLLM's ``prompt_logprobs`` give the
log-probability of every token after ``context + 1``, the tokens kvmix's own scoring scores.
Writes {method: {"nll": [...], "ppl": ..., "seconds": ..., "block_size": ...}}.
"""

from __future__ import annotations

import gc
import json
import math
import os
import sys
import time
from typing import Any

CHUNK = 256  # tokens a step prefills: a long text goes through the packed cache in chunks
SMALLEST_BLOCK = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens


def block_size(method: str) -> int:
    """The smallest vLLM block of at least ``SMALLEST_BLOCK`` tokens that holds whole groups
    of ``method``."""
    from kvmix.methods import parse_method

    group = 1 if method == "full" else parse_method(method).group
    return group * math.ceil(SMALLEST_BLOCK / group)


def score(model: str, ids: list[int], context: int, method: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    extra = {} if method == "full" else {"additional_config": {"kvmix": method}}
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=len(ids) + 1,
              skip_tokenizer_init=True,
              max_num_batched_tokens=CHUNK, block_size=block_size(method),
              gpu_memory_utilization=0.5, seed=0, **extra)
    try:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
        seconds = time.perf_counter() - start
        nll = [-out.prompt_logprobs[j][ids[j]].logprob for j in range(context + 1, len(ids))]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        _forget()
    return {"nll": nll, "ppl": math.exp(sum(nll) / len(nll)), "seconds": seconds,
            "block_size": block_size(method)}


def _forget() -> None:
    """vLLM's per-process state between engines (its backend choice ignores the kvmix config)."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.v1.attention.selector import _cached_get_attn_backend

    gc.collect()
    cleanup_dist_env_and_memory()
    _cached_get_attn_backend.cache_clear()


def main(argv: list[str]) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engines in this process
    request_path, out_path = argv
    with open(request_path) as f:
        request = json.load(f)
    results = {m: score(request["model"], request["ids"], request["context"], m)
               for m in request["methods"]}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
