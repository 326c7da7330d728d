"""The decode step on a GPU without host work, on synthetic caches of an 8B-like layer (32 query
heads over 8 KV heads of dimension 128, float16), Triton backend, pools sized up front:

1. ``sync``: decode steps (every layer call's update, write and attention) under
   ``torch.cuda.set_sync_debug_mode("error")``, so that any host sync inside them raises;
   pages sealed after the attention (host work between steps) run outside it;
2. ``captured``: a step's attention (``attend_batch``: the page-and-slot kernel and the merge)
   captured once as a CUDA graph, then replayed after each of ``--steps`` eager steps (new
   tokens, pages sealed, the step's metadata copied into its persistent tensors): each replay
   against the eager call on the same state (max abs difference; 0 when the graph reads what
   changed);
3. ``host_us`` / ``device_us``: µs per layer step of the eager step (the calls alone, and with
   the device done), and of the replayed attention (``graph_us``).

Every figure is measured; a part that cannot run says why in its row. The default context
(15000) keeps every row's pages within one block-table bucket through the steps (a replay
after the table or the pool grew would read freed tensors: the script stops replaying there).
Usage:
  python scripts/gpu_step.py --out DIR [--methods kivi2,pnmix1] [--context 15000]
      [--batch 1,8] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from kvmix.bench.opbench import Shape, Tokens, synthetic
from kvmix.runtime.kernels import gpu
from kvmix.runtime.layer import KVMixLayer


def build(method: str, shape: Shape, context: int, batch: int, steps: int, device):
    """A one-layer cache holding ``context`` tokens per sequence in a pool sized up front, its
    decode step, its token source and its scaling."""
    tokens = Tokens(shape, batch, torch.float16, device)
    cache, step = synthetic(shape, method, "triton", context, tokens, max_batch=batch,
                            max_tokens=context + steps + 512)
    return cache, step, tokens, shape.head_dim ** -0.5


def sync_free(step, steps: int) -> str:
    """'ok', or the first sync a step's update, write or attention made."""
    originals = {name: getattr(KVMixLayer, name) for name in ("update", "_write_and_attend")}

    def strict(function):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode("error")
            try:
                return function(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return run

    try:
        for name, function in originals.items():
            setattr(KVMixLayer, name, strict(function))
        for _ in range(steps):
            step()
        return "ok"
    except RuntimeError as error:
        return f"synced: {str(error).splitlines()[0]}"
    finally:
        for name, function in originals.items():
            setattr(KVMixLayer, name, function)


def timed(step, steps: int) -> tuple[float, float]:
    """µs per call: the calls alone, and with the device done."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    return 1e6 * host / steps, 1e6 * (time.perf_counter() - start) / steps


def captured(cache, step, tokens, scaling: float, steps: int) -> dict:
    """The attention captured once, replayed after every eager step, against eager."""
    layer = cache.layers[0]
    store, method = layer.store, cache.method
    query = method.transform_queries(tokens(1)[2], 0).contiguous()  # the graph's static input
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and size everything before the capture
        for _ in range(2):
            gpu.attend_batch(store, query, scaling)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gpu.attend_batch(store, query, scaling)
    bucket = buckets(store)
    pages, worst, replays = sum(map(len, store.pages)), 0.0, 0
    for _ in range(steps):
        step()  # eager: a new token in every row, pages sealed, metadata refreshed
        if buckets(store) != bucket:  # a table or pool that grew: the graph must be recaptured
            break
        query.copy_(method.transform_queries(tokens(1)[2], 0))
        graph.replay()
        eager = gpu.attend_batch(store, query, scaling)
        worst = max(worst, (out.float() - eager.float()).abs().max().item())
        replays += 1
    replay_us = timed(graph.replay, 50)[1] if buckets(store) == bucket else None
    return {"captured_max_abs_diff": worst, "replays": replays, "pages_sealed_between_replays":
            sum(map(len, store.pages)) - pages, "graph_us": replay_us}


def buckets(store) -> tuple:
    """What a captured graph holds by address: the block table's width and the pool's tensors
    (a change is a new bucket: capture again)."""
    return store.steps.table(store).width, store.pool.version


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default="kivi2,pnmix1")
    parser.add_argument("--context", default="15000")  # pages stay within a table bucket
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("scripts/gpu_step.py needs a CUDA device")
    device, shape, rows = torch.device("cuda"), Shape.parse("32,8,128"), []
    for method in args.methods.split(","):
        for context in map(int, args.context.split(",")):
            for batch in map(int, args.batch.split(",")):
                cache, step, tokens, scaling = build(method, shape, context, batch, args.steps,
                                                     device)
                for _ in range(3):
                    step()  # warm: kernels compiled, views built
                row = {"method": method, "context": context, "batch": batch,
                       "sync": sync_free(step, args.steps)}
                row["host_us"], row["device_us"] = timed(step, args.steps)
                try:
                    row.update(captured(cache, step, tokens, scaling, args.steps))
                except RuntimeError as error:
                    row["captured"] = f"failed: {str(error).splitlines()[0]}"
                rows.append(row)
                print(json.dumps(row), flush=True)
                del cache
                torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "step.json").write_text(json.dumps({"shape": "32:8x128", "dtype": "float16",
                                               "device": torch.cuda.get_device_name(),
                                               "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
