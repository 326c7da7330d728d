"""Accuracy as vLLM users measure it: lm-evaluation-harness's own ``local-completions`` model
against vLLM's OpenAI server, one server per cache (vLLM's own ``auto`` and ``fp8``, or kvmix's
plugin with a method), on kvmix's ``kvmix_passkey`` task (log-likelihood of the pass key at
depths 0.1, 0.5 and 0.9 of ``--lengths`` tokens). vLLM runs in its environment (``make vllm``);
lm-eval in this one (the ``eval`` extra).

    .venv/bin/python scripts/vllm_lm_eval.py MODEL_DIR --caches auto,kivi2,pnmix1 \\
        --lengths 1024,2048 --samples 4 --out DIR

MODEL_DIR: a float model folder with its tokenizer (vLLM's server, lm-eval and the task read
it). Each server gets ``--memory`` bytes of cache (its staging counted, as ``kvmix loadtest`` counts
it), prefix caching off (every prompt is computed through the cache).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import lm_eval

from kvmix.engines.vllm.server import DEFAULT_PYTHON, VllmServer
from kvmix.evaluation.harness import task_manager
from kvmix.jobs import report
from kvmix.jobs.report import print_table, write_results
from kvmix.methods import split_methods


def accuracy(python: str, model: str, cache: str, lengths: list[int], samples: int,
             memory: int, logs: Path) -> dict:
    """``kvmix_passkey``'s accuracy per length through vLLM's server with ``cache``."""
    server = VllmServer(python, model, f"vllm:{cache}", memory, max(lengths) + 64,
                        logs / f"{cache}.log", sequences=4,
                        extra=["--block-size", "128", "--no-enable-prefix-caching"])
    with server as url:
        results = lm_eval.simple_evaluate(
            model="local-completions", tasks=["kvmix_passkey"],
            task_manager=task_manager(model, lengths, samples=samples),
            model_args={"model": model, "base_url": f"{url}/v1/completions",
                        "tokenizer": model, "tokenized_requests": True, "num_concurrent": 2,
                        "max_length": max(lengths) + 64},
            log_samples=True)
    by_length: dict[int, list[float]] = {}
    for sample in results["samples"]["kvmix_passkey"]:
        by_length.setdefault(sample["doc"]["length"], []).append(sample["acc"])
    return {"cache": cache, "version": server.version(),
            "acc": results["results"]["kvmix_passkey"]["acc,none"],
            **{f"acc@{n}": sum(v) / len(v) for n, v in sorted(by_length.items())},
            "samples": sum(len(v) for v in by_length.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--caches", default="auto,kivi2,pnmix1")
    parser.add_argument("--lengths", default="1024,2048")
    parser.add_argument("--samples", type=int, default=4, help="per length and depth")
    parser.add_argument("--memory", type=int, default=1 << 30, help="bytes of cache")
    parser.add_argument("--vllm-python", default=DEFAULT_PYTHON)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    columns = {"cache": "cache", "acc": "acc", **{f"acc@{n}": f"acc@{n}" for n in lengths},
               "samples": "samples", "version": "vLLM"}
    with tempfile.TemporaryDirectory() as logs:
        report.invocation = ["python", "scripts/vllm_lm_eval.py", *sys.argv[1:]]
        rows = []
        for cache in split_methods(args.caches):  # each row written as it is measured
            rows.append(accuracy(args.vllm_python, args.model, cache, lengths, args.samples,
                                 args.memory, Path(logs)))
            if args.out:
                path = write_results(args.out, "vllm_lm_eval", vars(args), rows,
                                     ("kvmix_passkey through vLLM", columns))
                print(json.dumps({"wrote": str(path)}))
    print_table("kvmix_passkey through vLLM's server (lm-eval local-completions)", rows,
                columns)


if __name__ == "__main__":
    main()
