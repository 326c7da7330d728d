"""Throughput at equal memory on a GPU, with a random-weight model built from a config (the
default model's GGUF does not travel to the device):

1. ``kvmix bench --throughput`` on it: kvmix's caches through ``generate`` beside
   DynamicCache, at batch 1/8/32 and at each cache's largest batch within the budget;
2. served: ``--requests`` prompts of ``--prompt-tokens`` random tokens, ``--new-tokens`` each,
   through kvmix's continuous batching (kivi2, pnmix1) and through transformers' own paged
   float continuous batching with its CUDA graphs on, each with ``--memory`` of cache:
   output tokens/s and the ratio to transformers' (``served.json``).

Token ids are random (a random-weight model reads any text alike); every figure is measured,
and a row that fails records its error. Usage:
  python scripts/gpu_throughput.py --out DIR [--memory 512MB] [--batch 1,8,32]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvmix.capacity import parse_memory
from kvmix.commands.bench import BenchConfig, run_bench
from kvmix.models.loading import LoadedModel
from kvmix.serving.anchor import TransformersManager
from kvmix.serving.paged import KVMixManager

# A 1B-class Llama shape (TinyLlama-1.1B's attention: 32 query heads, 4 KV heads, head dim 64),
# fewer layers so that prefills of large batches stay short.
SHAPE = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 8,
         "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 64,
         "vocab_size": 32000, "max_position_embeddings": 8192, "rope_theta": 10000.0}


class RandomTokens:
    """Stands in for a tokenizer: any text becomes the same long run of random ids."""

    def __init__(self, vocab: int, count: int = 400_000):
        generator = torch.Generator().manual_seed(0)
        self.ids = torch.randint(3, vocab, (1, count), generator=generator)

    def __call__(self, text, return_tensors=None, add_special_tokens=False):
        return SimpleNamespace(input_ids=self.ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    parser.add_argument("--memory", default="512MB")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to("cuda", dtype).eval()
    loaded = LoadedModel(model, RandomTokens(SHAPE["vocab_size"]), "random-llama-1b-8l",
                         "random weights from a LlamaConfig", dtype)
    config = BenchConfig(methods=["full", "kivi2", "pnmix1"], baselines=["dynamic"],
                         prompt_tokens=[2048], budget_tokens=256, throughput=True,
                         memory=args.memory, batch=[int(b) for b in args.batch.split(",")],
                         new_tokens=16, warmup=2, rounds=2, backend=["triton"], device="cuda",
                         dtype=args.dtype, out=args.out)
    run_bench(config, loaded=loaded)
    served(model, args)


def served(model, args) -> None:
    """Output tokens/s of continuous batching at equal memory (see the module docstring)."""
    memory = parse_memory(args.memory)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (args.prompt_tokens,), generator=generator)
               .tolist() for _ in range(args.requests)]
    length = args.prompt_tokens + args.new_tokens
    managers = {"transformers+graphs": lambda: TransformersManager(
        model, memory, args.new_tokens, cuda_graphs=True)}
    managers |= {method: lambda method=method: KVMixManager(
        model, method, memory, "triton", args.new_tokens, length=length)
        for method in ("kivi2", "pnmix1")}
    rows = []
    for name, make in managers.items():
        row = {"server": name, "memory": memory, "requests": args.requests,
               "prompt": args.prompt_tokens, "tokens": args.new_tokens}
        try:
            manager = make()
            start = time.perf_counter()
            results = manager.complete(prompts, args.new_tokens)
            seconds = time.perf_counter() - start
            row["output_tokens_per_s"] = sum(len(r.generated_tokens) for r in results) / seconds
            row["seconds"] = seconds
        except Exception as error:
            row["error"] = f"{type(error).__name__}: {error}"
        rows.append(row)
        print(json.dumps(row), flush=True)
    anchor = rows[0].get("output_tokens_per_s")
    for row in rows:
        if anchor and "output_tokens_per_s" in row:
            row["vs_transformers_graphs"] = row["output_tokens_per_s"] / anchor
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "served.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
