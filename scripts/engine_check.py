"""The engine cross-check (``make engine-check``; not in CI: ``make engine`` builds llama.cpp
for about 25 minutes on 2 cores, once): the same tokens of the bundled prose through llama.cpp
with each ``--cache-type-k/-v`` pair and through kvmix's ``ggml`` method with the same types,
side by side — perplexity of the second half and token KL against each side's own f16 cache.

llama.cpp runs the default model's GGUF (its Q4_1 weights, quantized matmuls) and scores the
whole text as one batch, every token attending over the quantized cache; kvmix runs the same file
dequantized by transformers, prefills the first half and decodes the second in chunks of
``--chunk`` tokens over its ggml cache. Both rotate each quantized side by a Hadamard matrix
(llama.cpp's default since #21038; ``--no-rotation`` turns it off on both sides:
``LLAMA_ATTN_ROT_DISABLE=1`` and ``ggml:rotate=none``). Each side's KL is against its own f16
run, so the weight formats cancel; what remains is how well kvmix predicts the engine's cache
error. kvmix rounds each query as llama.cpp's CPU flash attention does against quantized keys
(``ggml:query=engine``; ``--query float`` keeps it float, as kvmix did before modelling it).

The engine's floor: a bf16/bf16 cache (no quantization; each value rounded to 8 significant
bits) is the smallest change of the cache the engine offers. Its KL says how far the engine's
own quantized weights and 8-bit activations carry any small change of the cache; kvmix's float
model carries it only as far as the change itself. (The engine is deterministic: re-running
with other micro-batches gives KL 0, and an f32 cache gives what its f16 cache gives.)

Usage: python scripts/engine_check.py [--tokens 1536] [--chunk 1] [--query engine|float]
       [--pairs q8_0/q8_0,q4_0/q4_0] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np
import torch

from kvmix.engines.llamacpp.build import bindings, server_version
from kvmix.engines.llamacpp.decoder import ggml_type
from kvmix.evaluation.data import load_text, token_ids
from kvmix.evaluation.scoring import score, token_kl
from kvmix.jobs.report import print_table, write_results
from kvmix.models.loading import load_model, smollm2_location

PAIRS = [("f16", "f16"), ("bf16", "bf16"), ("q8_0", "q8_0"), ("q8_0", "q4_0"),
         ("q4_0", "q8_0"), ("q4_0", "q4_0"), ("q5_1", "q5_1"), ("q4_1", "q4_1")]
COLUMNS = {"k": "K", "v": "V", "engine_ppl": "llama.cpp ppl", "kvmix_ppl": "kvmix ppl",
           "engine_kl": "llama.cpp KL", "kvmix_kl": "kvmix KL", "kl_ratio": "kvmix/engine"}


def engine_logprobs(ids: list[int], k: str, v: str, context: int, threads: int) -> torch.Tensor:
    """llama.cpp's next-token log-probabilities at positions context..T-2: [N, V]."""
    folder, gguf = smollm2_location()
    llm = bindings().Llama(
        model_path=str(Path(folder) / gguf), n_ctx=len(ids) + 16, n_batch=len(ids),
        n_ubatch=512, logits_all=True, flash_attn=True, type_k=ggml_type(k),
        type_v=ggml_type(v), n_threads=threads, verbose=False)
    llm.eval(ids)
    logits = torch.from_numpy(np.array(llm.scores[context : len(ids) - 1], dtype=np.float32))
    del llm
    return torch.log_softmax(logits, dim=-1)


def perplexity(logprobs: torch.Tensor, targets: torch.Tensor) -> float:
    return float(torch.exp(-logprobs.gather(1, targets[:, None]).mean()))


def ties_agree(rows: list[dict]) -> bool:
    """The same ordering on both sides, where pairs within 5% of each other count as ties:
    no two pairs that differ by more than 5% on both sides are ordered oppositely."""
    def apart(a: float, b: float) -> bool:
        return abs(a - b) > 0.05 * max(a, b)

    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            e, m = a["engine_kl"] - b["engine_kl"], a["kvmix_kl"] - b["kvmix_kl"]
            if (apart(a["engine_kl"], b["engine_kl"]) and apart(a["kvmix_kl"], b["kvmix_kl"])
                    and e * m < 0):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--chunk", type=int, default=1)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-rotation", action="store_true")
    parser.add_argument("--query", default="engine", choices=("engine", "float"))
    parser.add_argument("--pairs", default="", help="K/V pairs to run (f16/f16 and bf16/bf16 "
                                                    "always run); default: all")
    parser.add_argument("--out", default="results/engine-check")
    args = parser.parse_args()
    rotate = "none" if args.no_rotation else "auto"
    if args.no_rotation:
        os.environ["LLAMA_ATTN_ROT_DISABLE"] = "1"  # read when each llama.cpp context is made
    loaded = load_model()
    ids = token_ids(loaded.tokenizer, load_text("prose"), args.tokens)  # [1, T]
    context = args.tokens // 2
    targets = ids[0, context + 1 :]
    chosen = [tuple(pair.split("/")) for pair in args.pairs.split(",") if pair]
    pairs = [p for p in PAIRS if not chosen or p in chosen or "f16" in p[0]]
    engine, kvmix = {}, {}
    for k, v in pairs:
        engine[k, v] = engine_logprobs(ids[0].tolist(), k, v, context, args.threads)
        method = f"ggml:k={k},v={v},rotate={rotate},query={args.query}"
        kvmix[k, v] = score(loaded.model, ids, method, context, args.chunk,
                            backend="torch").logprobs
        print(f"{k}/{v} done", flush=True)
    rows = []
    for k, v in pairs:
        e_kl = token_kl(engine["f16", "f16"], engine[k, v])
        m_kl = token_kl(kvmix["f16", "f16"], kvmix[k, v])
        rows.append({"k": k, "v": v, "engine_ppl": perplexity(engine[k, v], targets),
                     "kvmix_ppl": perplexity(kvmix[k, v], targets), "engine_kl": e_kl,
                     "kvmix_kl": m_kl, "kl_ratio": m_kl / e_kl if e_kl > 0 else None})
    print_table(f"engine check · {args.tokens} tokens of prose, second half scored", rows,
                COLUMNS)
    quantized = [r for r in rows if not {r["k"], r["v"]} & {"f16", "bf16"}]  # quantized only
    order = [sorted(quantized, key=lambda r: r[side])
             for side in ("engine_kl", "kvmix_kl")]
    same_order = [(r["k"], r["v"]) for r in order[0]] == [(r["k"], r["v"]) for r in order[1]]
    summary = {"same_order": same_order, "ties_5_percent": ties_agree(quantized),
               "within_20_percent": [abs(r["kl_ratio"] - 1) <= 0.2 for r in quantized],
               "engine_floor_kl": rows[1]["engine_kl"], "kvmix_bf16_kl": rows[1]["kvmix_kl"]}
    print(json.dumps(summary))
    write_results(args.out, "engine-check", vars(args), rows, summary=summary,
                  engine={"llama_cpp_python": bindings().__version__,
                          "build": server_version()},
                  model={"name": loaded.name, "source": loaded.source})


if __name__ == "__main__":
    main()
