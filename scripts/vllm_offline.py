"""vLLM's offline engine (``LLM.generate``) at a KV budget, with and without kvmix's plugin:
24 random 512-token prompts, 96 greedy tokens each, timed as prefill alone (one token) and
whole (batch 1: the fastest of three rounds). Every round draws prompts of its own, so that no
round reads another's blocks from vLLM's prefix cache (kvmix's pages hold 10x the tokens of
vLLM's float pages: a repeated prompt would be prefilled once for kvmix only). In the vLLM
environment:

    .venv-vllm/bin/python scripts/vllm_offline.py MODEL_DIR kivi2   # or auto, fp8
    .venv-vllm/bin/python scripts/vllm_offline.py MODEL_DIR kivi2 1  # batch 1: one prompt

MODEL_DIR: a float model folder (``kvmix.engines.vllm.scoring.float_folder`` writes one).
``MP=1`` runs the engine core in a process of its own, as vLLM's server does."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", os.environ.get("MP", "0"))
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB: it would override the budget

BUDGET = 90 << 20  # bytes of KV cache (vLLM's pages and, with kvmix, its staging)
PROMPT, TOKENS = 512, 96


def main(model: str, setting: str, prompts: str = "24") -> None:
    import torch
    from vllm import LLM, SamplingParams

    from kvmix.engines.vllm.server import staging_bytes

    cache = {"kv_cache_dtype": setting} if setting in ("auto", "fp8") else {
        "additional_config": {"kvmix": {"method": setting}}}
    count = int(prompts)
    # the budget holds the plugin's float staging too (sized by the sequences that may run)
    pages = BUDGET - staging_bytes(model, f"vllm:{setting}", count)
    llm = LLM(model, dtype="float32", enforce_eager=True, skip_tokenizer_init=True,
              max_model_len=PROMPT + TOKENS + 1, kv_cache_memory_bytes=pages,
              max_num_seqs=count, seed=0, **cache)
    g = torch.Generator().manual_seed(0)

    def seconds(tokens: int) -> float:
        prompts = [{"prompt_token_ids": torch.randint(100, 40000, (PROMPT,), generator=g).tolist()}
                   for _ in range(count)]
        start = time.perf_counter()
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == tokens for o in outputs)
        return time.perf_counter() - start

    seconds(1)  # warm-up
    rounds = 3 if count == 1 else 1  # batch 1 is short and noisy here: the fastest of three
    prefill = min(seconds(1) for _ in range(rounds))
    whole = min(seconds(TOKENS) for _ in range(rounds))
    step = (whole - prefill) / (TOKENS - 1) * 1e3
    print(f"{setting} x{count}: prefill alone {prefill:.1f} s, {TOKENS} tokens {whole:.1f} s "
          f"(decode {whole - prefill:.1f} s, {step:.1f} ms a step), "
          f"{count * TOKENS / whole:.1f} output tok/s", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
