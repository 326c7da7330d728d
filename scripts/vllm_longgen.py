"""Long generations through vLLM, each cache beside vLLM's float cache (``auto``): ``--prompts``
prose prompts of ``--prompt-tokens`` tokens, ``--new-tokens`` greedy tokens each (EOS ignored),
by vLLM's offline engine with its own cache or kvmix's plugin. Per cache: where its greedy text
first leaves the float cache's (tokens; survival: the share of prompts still identical), and,
teacher-forced on the float cache's text, the mean log-likelihood it loses on those tokens
(Δnll, nats a token; vLLM's ``prompt_logprobs``). Each cache runs in a process of its own. In
the vLLM environment:

    .venv-vllm/bin/python scripts/vllm_longgen.py MODEL_DIR \\
        --caches auto,fp8,kivi2,pnmix1,kxvy:key_bits=4,value_bits=2 --out DIR

MODEL_DIR: a float model folder with its tokenizer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # whole GiB: it would override the budget
OWN = ("auto", "fp8")  # vLLM's own caches; anything else is a kvmix method


def prompts(model: str, count: int, length: int) -> list[list[int]]:
    """``count`` prose prompts of ``length`` tokens, from places far apart in the text."""
    from transformers import AutoTokenizer

    from kvmix.evaluation.data import load_text

    ids = AutoTokenizer.from_pretrained(model)(load_text("prose")).input_ids
    stride = (len(ids) - length) // count
    return [ids[i * stride : i * stride + length] for i in range(count)]


def generate(model: str, cache: str, asked: list[list[int]], new: int,
             reference: list[list[int]] | None) -> dict:
    """One cache: its greedy continuations, and the log-likelihood of ``reference``'s."""
    from vllm import LLM, SamplingParams

    options = {"kv_cache_dtype": cache} if cache in OWN else {
        "additional_config": {"kvmix": {"method": cache}}}
    llm = LLM(model, dtype="float32", enforce_eager=True, seed=0, block_size=128,
              max_model_len=len(asked[0]) + new + 64, kv_cache_memory_bytes=1 << 30,
              enable_prefix_caching=False, **options)
    outputs = llm.generate([{"prompt_token_ids": p} for p in asked],
                           SamplingParams(max_tokens=new, temperature=0, ignore_eos=True),
                           use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    texts = [p + c for p, c in zip(asked, reference or tokens, strict=True)]
    forced = llm.generate([{"prompt_token_ids": ids} for ids in texts],
                          SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [[-o.prompt_logprobs[i][ids[i]].logprob for i in range(len(p), len(ids))]
           for o, p, ids in zip(forced, asked, texts, strict=True)]
    return {"tokens": tokens, "nll": nll}


def row(cache: str, run: dict, reference: dict, new: int) -> dict:
    import torch

    from kvmix.evaluation.generation import first_divergence, survival

    diverged = first_divergence(torch.tensor(run["tokens"]),
                                torch.tensor(reference["tokens"])).tolist()
    alive = survival(diverged, new)
    loss = [m - r for mine, ref in zip(run["nll"], reference["nll"], strict=True)
            for m, r in zip(mine, ref, strict=True)]
    return {"cache": cache, "first_divergence_median": sorted(diverged)[len(diverged) // 2],
            "first_divergence_min": min(diverged),
            **{f"survival@{t}": alive[t] for t in (128, 512, new - 1) if t < new},
            "delta_nll": sum(loss) / len(loss), "prompts": len(diverged)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--caches", default="auto,kivi2,pnmix1")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=1024)
    parser.add_argument("--out", default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # FILE: one cache
    args = parser.parse_args()
    asked = prompts(args.model, args.prompts, args.prompt_tokens)
    if args.one:  # a child: one cache, the reference's tokens (if any) in the file
        job = json.loads(Path(args.one).read_text())
        result = generate(args.model, job["cache"], asked, args.new_tokens, job["reference"])
        Path(args.one).write_text(json.dumps(result))
        return
    from kvmix.jobs import report
    from kvmix.jobs.report import print_table, write_results
    from kvmix.methods import split_methods

    caches = split_methods(args.caches)
    reference, rows = None, []
    with tempfile.TemporaryDirectory() as folder:
        for cache in ["auto", *(c for c in caches if c != "auto")]:
            job = Path(folder) / "job.json"
            job.write_text(json.dumps({"cache": cache, "reference": reference and
                                       reference["tokens"]}))
            subprocess.run([sys.executable, __file__, *sys.argv[1:], "--one", str(job)],
                           check=True)
            run = json.loads(job.read_text())
            reference = reference or run
            rows.append(row(cache, run, reference, args.new_tokens))
    columns = {k: k for k in rows[0]}
    print_table("long generations through vLLM against its float cache", rows, columns)
    if args.out:
        report.invocation = ["python", "scripts/vllm_longgen.py", *sys.argv[1:]]
        print(write_results(args.out, "vllm_longgen", vars(args), rows,
                            ("long generations through vLLM", columns)))


if __name__ == "__main__":
    main()
