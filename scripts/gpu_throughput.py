"""Throughput at equal memory on a GPU, with a random-weight model built from a config (the
default model's GGUF does not travel to the device): ``kvmix bench --throughput`` on it.

Token ids are random (a random-weight model reads any text alike); every figure is measured.
Usage: python scripts/gpu_throughput.py --out DIR [--memory 512MB] [--batch 1,8,32]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvmix.commands.bench import BenchConfig, run_bench
from kvmix.models.loading import LoadedModel

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
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE)).to("cuda", dtype).eval()
    loaded = LoadedModel(model, RandomTokens(SHAPE["vocab_size"]), "random-llama-1b-8l",
                         "random weights from a LlamaConfig", dtype)
    config = BenchConfig(methods=["full", "kivi2", "pnmix1"], baselines=["dynamic"],
                         prompt=[2048], tokens=256, throughput=True, memory=args.memory,
                         batch=[int(b) for b in args.batch.split(",")], new_tokens=16,
                         warmup=2, rounds=2, backend=["triton"], device="cuda",
                         dtype=args.dtype, out=args.out)
    run_bench(config, loaded=loaded)


if __name__ == "__main__":
    main()
