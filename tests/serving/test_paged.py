"""Continuous batching with kvmix's pool on transformers' machinery: every request's greedy
tokens are what ``generate`` gives its prompt alone with the same method, whatever runs beside
it; requests wait while their bytes do not fit and never run beyond the budget; pages go back
to the pool when requests end; what can never be served is refused before any work."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import tiny_llama
from helpers import method_string
from transformers import MistralConfig, MistralForCausalLM

import kvmix
from kvmix.serving.paged import KVMixManager, KVMixPagedCache, generate_batch

LENGTHS = (20, 37, 51, 5, 70, 33)
NEW = 40


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=4)


def prompts(lengths=LENGTHS, seed: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def alone(model, method: str, prompt: list[int], backend: str = "auto") -> list[int]:
    runner = kvmix.prepare_model(model, method)
    cache = kvmix.make_cache(runner, method, backend=backend)
    with torch.no_grad():
        out = runner.generate(torch.tensor([prompt]), cache=cache, max_new_tokens=NEW,
                              do_sample=False)  # stops at the EOS, as a served request
    return out[0, len(prompt):].tolist()


def budget_for(model, method: str, requests: float, tokens: int) -> float:
    """Bytes that hold ``requests`` requests of ``tokens`` tokens by the planner's formula."""
    budget = KVMixManager(model, method, 1e9).budget
    return requests * budget.footprint(tokens) + budget.static


def watch_steps(monkeypatch) -> list[tuple[int, float, float, float]]:
    """At every forward's plan: (rows, bytes reserved, bytes the cache holds for tokens, bytes
    of every storage it keeps but the static tensors)."""
    seen, plan = [], KVMixPagedCache._plan

    def recorded(cache):
        step = plan(cache)
        kinds = cache.kv.nbytes_breakdown()
        kept = sum(kinds.values()) - kinds.get("static", 0)
        seen.append((len(cache.order), cache.reserved_bytes(), kept - kinds.get("free", 0),
                     kept))
        return step

    monkeypatch.setattr(KVMixPagedCache, "_plan", recorded)
    return seen


@pytest.mark.parametrize(("name", "backend"), [
    ("kivi2", "auto"), ("pnmix1", "auto"), ("full", "auto"), ("kitty", "auto"),
    ("chanmix", "auto"), ("polar", "torch"), ("ggml-k8v4", "auto"), ("wush", "auto"),
    ("kivi2", "torch"), ("pnmix1", "torch")])
def test_each_request_gets_what_generate_gives_it_alone(model, name, backend, monkeypatch):
    """Six prompts with a budget of 2.5 of them: requests join as others leave (several pages
    sealed per request, at different steps), and each one's 40 greedy tokens equal its solo
    run's, token for token; the cache's storage stays within the budget."""
    method = method_string(name, model if name == "wush" else None)
    memory = budget_for(model, method, 2.5, max(LENGTHS) + NEW)
    steps = watch_steps(monkeypatch)
    out = generate_batch(model, prompts(), method, NEW, memory, backend)
    for b, prompt in enumerate(prompts()):
        assert out[b] == alone(model, method, prompt, backend), f"request {b}"
    assert 2 <= max(rows for rows, *_ in steps) < len(LENGTHS)  # several at once; some waited
    assert all(held <= reserved for _, reserved, held, _ in steps)  # what is held was reserved
    static = KVMixManager(model, method, 1e9).budget.static
    assert max(kept for *_, kept in steps) <= memory - static  # never more storage than that


def test_requests_wait_for_bytes_and_return_their_pages(model):
    """A budget of one request: they run one at a time, in order of arrival; once all end,
    every layer's pool holds no page in use and no row, and nothing stays reserved."""
    method = method_string("kivi2")
    manager = KVMixManager(model, method, budget_for(model, method, 1.2, 110), max_new_tokens=NEW,
                           length=110)
    manager.start()
    try:
        ids = [manager.add_request(p) for p in prompts()]
        results = {}
        while len(results) < len(ids):
            result = manager.get_result(timeout=5)
            assert result is not None and result.error is None
            results[result.request_id] = result
        cache = manager.cache
        for layer in cache.layers:
            assert layer.pool.used == 0 and layer.store.batch == 0
            assert layer.pool.capacity > 0  # pages were sealed, and all went back
        assert not cache.reserved and not cache.rows and not cache.order
        spans = sorted((r.lifespan for r in results.values()), key=lambda s: s[0])
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))  # never two at once
        assert [r.request_id for r in sorted(results.values(), key=lambda r: r.lifespan[0])] \
            == ids
    finally:
        manager.stop(block=True)


def test_a_sliding_window_model_serves_each_request_as_alone():
    """Mistral with a window shorter than the prompts: pages behind each request's window go
    back to the pool while it runs, and its tokens are still its solo run's."""
    torch.manual_seed(3)
    config = MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=32, sliding_window=24, max_position_embeddings=512)
    mistral = MistralForCausalLM(config).eval()
    method = method_string("pnmix1")
    out = generate_batch(mistral, prompts(), method, NEW, 1e8)
    assert out == [alone(mistral, method, p) for p in prompts()]


def test_what_can_never_be_served_is_refused_before_any_work(model):
    """A prompt beyond the model's positions, a request beyond the budget (or a budget that
    holds no request of the size it is split for), an empty prompt, a bad max_new_tokens:
    ValueError naming the limit, no thread started."""
    method = method_string("kivi2")
    memory = budget_for(model, method, 1.5, 100)
    with pytest.raises(ValueError, match="512 positions"):
        generate_batch(model, [list(range(1, 500))], method, 20, 1e8)
    with pytest.raises(ValueError, match=r"holds no request of 470 tokens"):
        generate_batch(model, prompts(), method, 400, memory)
    why = KVMixManager(model, method, memory, length=100).refusal(50, 400)
    assert "beyond the budget memory=" in why and "at most" in why
    with pytest.raises(ValueError, match="prompt is empty"):
        generate_batch(model, [[]], method, 20, 1e8)
    with pytest.raises(ValueError, match=r"max_new_tokens. must be greater than 0"):
        generate_batch(model, prompts(), method, 0, 1e8)
    with pytest.raises(ValueError, match="exceeds max_batch_tokens=64"):
        generate_batch(model, [list(range(1, 80))], method, 20, 1e8, max_batch_tokens=64)
    with pytest.raises(ValueError, match=r"static tensors"):
        KVMixManager(model, method, 1.0)
    with pytest.raises(ValueError, match="unknown method"):
        KVMixManager(model, "kivi9", 1e8)


def test_the_loop_decodes_every_running_request_in_one_call_per_layer(model, monkeypatch):
    """However many requests run, a forward makes one decode call per layer (the rows are
    the running requests), and a prompt is never split across forwards."""
    from kvmix.runtime.layer import KVMixLayer

    calls, joins, decode, join = [], [], KVMixLayer.decode, KVMixLayer.join

    def counted(layer, query, *rest):
        calls.append((layer.layer_idx, query.shape[0]))
        return decode(layer, query, *rest)

    def joined(layer, prompts, scaling):
        joins.extend(p[1].shape[-2] for p in prompts if layer.layer_idx == 0)
        return join(layer, prompts, scaling)

    monkeypatch.setattr(KVMixLayer, "decode", counted)
    monkeypatch.setattr(KVMixLayer, "join", joined)
    method = method_string("kivi2")
    generate_batch(model, prompts(), method, 8, 1e8, max_batch_tokens=90)
    assert sorted(joins) == sorted(LENGTHS)  # each prompt whole, in one forward
    per_layer = [n for layer, n in calls if layer == 0]
    assert len(per_layer) == len([n for layer, n in calls if layer == 1])
    assert max(per_layer) > 1  # several requests shared one call


@pytest.mark.integration
def test_the_default_model_serves_eight_requests_as_generate_does_alone(real_model):
    """The real model: eight prose prompts of different lengths through continuous batching,
    each one's 32 greedy tokens equal to generate's for it alone (pnmix1)."""
    from kvmix.evaluation.data import prompt_set

    model, tokenizer = real_model.model, real_model.tokenizer
    texts = [p[: 60 + 17 * i] for i, p in enumerate(prompt_set("prose", tokenizer, 8, 200))]
    out = generate_batch(model, texts, "pnmix1", 32, 3e9)
    for prompt, tokens in zip(texts, out, strict=True):
        with torch.no_grad():
            solo = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                  cache=kvmix.make_cache(model, "pnmix1"))
        assert tokens == solo[0, len(prompt):].tolist()
