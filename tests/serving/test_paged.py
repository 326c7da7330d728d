"""Continuous batching with kvmix's pool on transformers' machinery: every request's greedy
tokens are what ``generate`` gives its prompt alone with the same method, whatever runs beside
it; requests wait while their bytes do not fit and never run beyond the budget; pages go back
to the pool when requests end; what can never be served is refused before any work."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
import torch
from conftest import run_requests, tiny_llama
from helpers import RESIDUAL, SINK, method_string
from transformers import LogitsProcessor, LogitsProcessorList, MistralConfig, MistralForCausalLM

import kvmix
from kvmix.core.memory import storage_bytes
from kvmix.runtime.store import sealed_groups
from kvmix.serving.paged import KVMixManager, KVMixPagedCache, generate_batch
from kvmix.serving.sampling import RequestFault, Sampling

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
    seen, plan = [], KVMixPagedCache._segments

    def recorded(cache):
        step = plan(cache)
        kinds = cache.kv.nbytes_breakdown()
        kept = sum(kinds.values()) - kinds.get("static", 0)
        seen.append((len(cache.order), cache.reserved_bytes(), kept - kinds.get("free", 0),
                     kept))
        return step

    monkeypatch.setattr(KVMixPagedCache, "_segments", recorded)
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


def test_the_budget_prices_float_slots_at_the_bytes_the_cache_allocates(model):
    """The budget's split counts each row's float slots at the dtype the cache allocates them
    in: float16 by default in this float32 model, half the bytes of float32 slots, so the same
    budget runs more requests at once."""
    memory = budget_for(model, method_string("kivi2"), 4.5, 110)
    rows, per_row = {}, {}
    for dtype in ("float16", "float32"):
        method = method_string("kivi2") + f",residual_dtype={dtype}"
        manager = KVMixManager(model, method, memory, max_new_tokens=NEW, length=110)
        manager.start()
        try:
            manager.add_request(prompts()[0])
            result = manager.get_result(timeout=60)
            assert result is not None and result.error is None
            stores = [layer.store for layer in manager.cache.layers]
            slots = sum(storage_bytes(s.keys) + storage_bytes(s.values) for s in stores)
            assert {s.keys.dtype for s in stores} == {getattr(torch, dtype)}
            budget = manager.budget
            assert slots == budget.rows * budget.slots > 0  # what the split counted
            rows[dtype], per_row[dtype] = budget.rows, budget.slots
        finally:
            manager.stop(block=True)
    assert 2 * per_row["float16"] == per_row["float32"]
    assert rows["float16"] > rows["float32"]


def test_the_split_follows_the_load(model, monkeypatch):
    """A budget split at start-up for one request of 110 tokens: one whole sink and residual
    (20 slots) per layer, the rest pages. Requests of 5 + 4 tokens can fill 9 slots each and
    seal no page, so the cache splits the bytes anew and all four run at once; requests of
    70 + 40 tokens then need pages, and the bytes go back. Each request gives its solo run's
    tokens, and the storage never exceeds the budget."""
    method = method_string("kivi2")
    memory = budget_for(model, method, 1.2, 110)
    manager = KVMixManager(model, method, memory, max_new_tokens=NEW, length=110)
    budget = manager.budget
    assert budget.rows == 1 and budget.arena == SINK + RESIDUAL
    steps, caches = watch_steps(monkeypatch), []
    plan = KVMixPagedCache._segments
    monkeypatch.setattr(KVMixPagedCache, "_segments", lambda c: caches.append(c) or plan(c))
    short, long = prompts((5, 5, 5, 5), seed=9), prompts((70, 60), seed=10)
    results = run_requests(manager, [
        *({"input_ids": p, "request_id": f"s{i}", "max_new_tokens": 4}
          for i, p in enumerate(short)),
        *({"input_ids": p, "request_id": f"l{i}"} for i, p in enumerate(long))])
    assert max(rows for rows, *_ in steps) == 4
    for i, p in enumerate(short):
        assert results[f"s{i}"].generated_tokens == alone(model, method, p)[:4], i
    for i, p in enumerate(long):
        assert results[f"l{i}"].generated_tokens == alone(model, method, p), i
    cache = caches[-1]
    assert cache.splits >= 2 and cache.slots_reserved == 0 and not cache.reserved
    assert all(held <= reserved for _, reserved, held, _ in steps)
    assert max(kept for *_, kept in steps) <= memory - budget.static


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

    def joined(layer, prompts, scaling, extents=None):
        joins.extend(p[1].shape[-2] for p in prompts if layer.layer_idx == 0)
        return join(layer, prompts, scaling, extents)

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


# -- sampling, choices, faults --------------------------------------------------------------------

def assert_nothing_held(manager) -> None:
    cache = manager.batch_processor.cache if manager.batch_processor else manager.cache
    if cache is None:
        return
    for layer in cache.layers:
        assert layer.pool.used == 0 and layer.store.batch == 0
    assert not cache.reserved and cache.rows_reserved == 0 and not cache.order


def test_a_seeded_request_draws_the_same_tokens_whatever_runs_beside_it(model):
    """temperature, top-k and top-p with a seed: the same tokens alone and beside four other
    requests (greedy and sampled); another seed draws other tokens."""
    method = method_string("kivi2")
    sampling = Sampling(temperature=0.9, top_p=0.95, top_k=40, seed=11)
    asked = {"input_ids": prompts()[1], "max_new_tokens": NEW, "eos_token_id": -1}

    def served(others: list[dict], seed: int = 11) -> list[int]:
        manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
        mine = {**asked, "request_id": "mine", "sampling": replace(sampling, seed=seed)}
        return run_requests(manager, [*others, mine])["mine"].generated_tokens

    beside = [{"input_ids": p, "request_id": f"o{i}", "sampling": Sampling(temperature=1.0)
               if i % 2 else None} for i, p in enumerate(prompts()[2:])]
    alone_tokens = served([])
    assert served(beside) == alone_tokens and len(alone_tokens) == NEW
    assert served([], seed=12) != alone_tokens


def test_sampling_goes_through_the_per_request_processors(model):
    """top_k=1 (or a tiny top_p) leaves one token to draw: the greedy one, as generate's."""
    method = method_string("kivi2")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    results = run_requests(manager, [
        {"input_ids": prompts()[0], "request_id": "k", "sampling": Sampling(1.5, top_k=1)},
        {"input_ids": prompts()[1], "request_id": "p", "sampling": Sampling(1.5, top_p=1e-6)},
        {"input_ids": prompts()[2], "request_id": "t", "sampling": Sampling(1e-4)}])
    for rid, prompt in zip("kpt", prompts()[:3], strict=True):
        assert results[rid].generated_tokens == alone(model, method, prompt), rid


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens generated after ``start``,
    written from their definition (the reference of the served sampler's)."""

    def __init__(self, start: int, presence: float, frequency: float):
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        for row, ids in enumerate(input_ids[:, self.start:].tolist()):
            for token in set(ids):
                scores[row, token] -= self.presence + self.frequency * ids.count(token)
        return scores


def reference(model, method: str, prompt: list[int], **kwargs) -> list[int]:
    """generate's greedy tokens for ``prompt`` alone with transformers' own processors."""
    runner = kvmix.prepare_model(model, method)
    with torch.no_grad():
        out = runner.generate(torch.tensor([prompt]), cache=kvmix.make_cache(runner, method),
                              max_new_tokens=NEW, do_sample=False, **kwargs)
    return out[0, len(prompt):].tolist()


def test_penalties_bias_and_min_tokens_match_transformers_processors(model):
    """Four greedy requests in one batch, each adjusting its logits another way, against
    generate alone with transformers' processors (or OpenAI's definition written out):
    repetition penalty; logit bias; min_tokens holding back an EOS that a bias forces; the
    repetition penalty then presence and frequency penalties. Each differs from plain greedy."""
    method = method_string("kivi2")
    eos = 3
    asks = {
        "r": (Sampling(repetition_penalty=1.5), {"repetition_penalty": 1.5}),
        "b": (Sampling(logit_bias=((7, 4.0), (9, -100.0))),
              {"sequence_bias": {(7,): 4.0, (9,): -100.0}}),
        "m": (Sampling(logit_bias=((eos, 60.0),), min_tokens=5),
              {"sequence_bias": {(eos,): 60.0}, "min_new_tokens": 5}),
        "p": (Sampling(repetition_penalty=1.3, presence_penalty=1.5, frequency_penalty=0.7),
              {"repetition_penalty": 1.3}),
    }
    chosen = dict(zip(asks, prompts()[:4], strict=True))
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    results = run_requests(manager, [
        {"input_ids": chosen[rid], "request_id": rid, "sampling": sampling, "eos_token_id": eos}
        for rid, (sampling, _) in asks.items()])
    for rid, (_, kwargs) in asks.items():
        prompt = chosen[rid]
        if rid == "p":
            kwargs = {**kwargs, "logits_processor": LogitsProcessorList(
                [OpenAIPenalties(len(prompt), 1.5, 0.7)])}
        expected = reference(model, method, prompt, eos_token_id=eos, **kwargs)
        assert results[rid].generated_tokens == expected, rid
        assert expected != reference(model, method, prompt, eos_token_id=eos), rid
    assert len(results["m"].generated_tokens) == 6


def test_min_p_of_one_leaves_the_most_likely_token(model):
    """min_p=1 keeps only the tokens as likely as the most likely one: a sampled request
    (temperature 1.5) gives the greedy tokens; min_p=0.0 the same seed draws others."""
    method = method_string("kivi2")
    prompt = prompts()[1]
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    results = run_requests(manager, [
        {"input_ids": prompt, "request_id": "one", "sampling": Sampling(1.5, min_p=1.0, seed=3)},
        {"input_ids": prompt, "request_id": "none", "sampling": Sampling(1.5, seed=3)}])
    assert results["one"].generated_tokens == alone(model, method, prompt)
    assert results["none"].generated_tokens != results["one"].generated_tokens


def test_sampling_refuses_values_the_sampler_cannot_compute(model):
    """Each out-of-range number, a top_k beyond the vocabulary and a biased id outside it are
    refused naming the parameter, before the request is queued."""
    for kwargs, name in [({"top_k": 1 << 31}, "top_k"), ({"min_p": 1.5}, "min_p"),
                         ({"repetition_penalty": 0.0}, "repetition_penalty"),
                         ({"presence_penalty": 3.0}, "presence_penalty"),
                         ({"logit_bias": ((1, 101.0),)}, "logit_bias"),
                         ({"min_tokens": -1}, "min_tokens")]:
        with pytest.raises(ValueError, match=name):
            Sampling(**kwargs)
    manager = KVMixManager(model, method_string("kivi2"), 1e8, max_new_tokens=NEW)
    vocab = model.config.vocab_size
    for sampling, name in [(Sampling(1.0, top_k=vocab + 1), "top_k"),
                           (Sampling(logit_bias=((vocab, 1.0),)), "logit_bias")]:
        with pytest.raises(ValueError, match=name):
            manager.add_request([1, 2, 3], sampling=sampling)
    assert manager.input_queue.qsize() == 0


def test_logprobs_come_from_the_logits_that_chose_each_token(model):
    """Greedy with logprobs=3: each chosen token's log-probability is generate's log-softmax
    of its logits; the alternatives are the three most likely, the chosen one first."""
    method = method_string("pnmix1")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    out = run_requests(manager, [{"input_ids": prompts()[4], "request_id": "x",
                                  "sampling": Sampling(logprobs=3)}])["x"]
    runner = kvmix.prepare_model(model, method)
    with torch.no_grad():
        solo = runner.generate(torch.tensor([prompts()[4]]), max_new_tokens=NEW,
                               do_sample=False, cache=kvmix.make_cache(runner, method),
                               output_logits=True, return_dict_in_generate=True)
    logp = torch.log_softmax(torch.stack(solo.logits)[:, 0].float(), -1)  # [NEW, V]
    tokens = solo.sequences[0, len(prompts()[4]):]
    assert out.generated_tokens == tokens.tolist()
    expected = logp.gather(1, tokens[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), expected, atol=1e-4)
    for i, top in enumerate(out.top_logprobs):
        assert [t for t, _ in top] == logp[i].topk(3).indices.tolist()
        assert top[0] == (tokens[i].item(), pytest.approx(expected[i].item(), abs=1e-4))


def test_n_choices_share_the_prompt_pages(model, monkeypatch):
    """n=3: the prompt (less its last token) is prefilled once; the two other choices fork from
    its row sharing its sealed pages (no page copied, each held three times); admission
    reserved three rows and the shared pages once; the choices draw different tokens."""
    method = method_string("kivi2")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    seen, fork = {}, KVMixPagedCache.prepare_fork_request

    def forked(cache, state, ids, copies):
        pool = cache.layers[0].pool
        seen["before"] = pool.used, cache.rows_reserved, cache.reserved_bytes()
        out = fork(cache, state, ids, copies)
        seen["after"] = pool.used, max(pool.refs)
        return out

    monkeypatch.setattr(KVMixPagedCache, "prepare_fork_request", forked)
    prompt = prompts((70,))[0]
    results = run_requests(manager, [{"input_ids": prompt, "request_id": "r", "n": 3,
                                      "eos_token_id": -1, "sampling": Sampling(1.0, seed=5)}])
    budget = manager.budget
    own, shared = budget.reservation(70 + NEW, 70, 3)
    pages = sealed_groups(budget.method, 69 - budget.method.sink)
    assert seen["before"] == (pages, 3, pytest.approx(3 * own.nbytes + shared.nbytes))
    assert seen["after"] == (pages, 3)
    assert shared.pages[0] == pages and own.nbytes < budget.footprint(70 + NEW)
    assert sorted(results) == ["r", "r__child#0", "r__child#1"]
    outs = [r.generated_tokens for r in results.values()]
    assert all(len(o) == NEW for o in outs) and len({tuple(o) for o in outs}) == 3
    assert_nothing_held(manager)


def test_an_injected_fault_fails_only_its_request(model):
    """A hook raises for one request at its 6th decode step: it fails with the cause, the
    others give what they give alone, and nothing stays held."""
    method = method_string("kivi2")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    target = prompts()[2]

    def inject(request_id: str, tokens: int) -> None:
        if request_id == "r2" and tokens == len(target) + 5:
            raise RuntimeError("injected")

    manager.inject = inject
    results = run_requests(manager, [{"input_ids": p, "request_id": f"r{i}"}
                                     for i, p in enumerate(prompts())])
    # its prefill and five decode steps went through: six tokens
    assert results["r2"].error == "RuntimeError: injected" and \
        len(results["r2"].generated_tokens) == 6
    for i, prompt in enumerate(prompts()):
        if i != 2:
            assert results[f"r{i}"].error is None
            assert results[f"r{i}"].generated_tokens == alone(model, method, prompt), i
    assert manager.stats.snapshot()["faulted_steps"] == 1
    assert_nothing_held(manager)


@pytest.mark.parametrize("name", ["kivi2", "pnmix1:selection=online"])
def test_a_fault_at_commit_in_a_later_layer_undoes_the_step_in_every_layer(model, monkeypatch,
                                                                          name):
    """Layer 1's commit fails (naming r2) at a step where residuals fill, after layer 0
    prepared its own: no layer keeps the step, r2 fails, and the others retry it and give,
    token for token and draw for draw (a seeded sampled request with logprobs beside greedy
    ones), what a fault-free run gives."""
    from kvmix.runtime.layer import KVMixLayer

    method = method_string(name)
    requests = [{"input_ids": p, "request_id": f"r{i}"} for i, p in enumerate(prompts()[:4])]
    requests[1]["sampling"] = Sampling(temperature=0.9, seed=7, logprobs=3)
    clean = run_requests(KVMixManager(model, method, 1e8, max_new_tokens=NEW),
                         [dict(r) for r in requests])
    fired, prepare = [], KVMixLayer.prepare_commit

    def failing(layer):
        decoding = layer._undo is not None and layer._undo.step is not None
        if layer.layer_idx == 1 and decoding and not fired and RESIDUAL in layer.store.res_len:
            fired.append(True)  # a row's residual is full: this commit would seal a page
            raise RequestFault({"r2": "injected at commit"})
        return prepare(layer)

    monkeypatch.setattr(KVMixLayer, "prepare_commit", failing)
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    results = run_requests(manager, [dict(r) for r in requests])
    assert results["r2"].error == "injected at commit"
    for rid in ("r0", "r1", "r3"):
        assert results[rid].error is None
        assert results[rid].generated_tokens == clean[rid].generated_tokens, rid
    # the retried step has one row fewer: float32 sums differ in the last ulps
    assert results["r1"].logprobs == pytest.approx(clean["r1"].logprobs, abs=1e-5)
    tops, clean_tops = results["r1"].top_logprobs, clean["r1"].top_logprobs
    assert [[t for t, _ in step] for step in tops] == [[t for t, _ in step] for step in clean_tops]
    assert [v for step in tops for _, v in step] == pytest.approx(
        [v for step in clean_tops for _, v in step], abs=1e-5)
    assert manager.stats.snapshot()["faulted_steps"] == 1
    assert_nothing_held(manager)


def test_a_fault_in_scheduling_fails_the_running_requests_and_the_loop_goes_on(model,
                                                                             monkeypatch):
    """Admission raises (a bug's stand-in) on r2 while r0 and r1, admitted in the same round,
    were made ready: those two fail with the error, the loop lives, and r2 and r3 (still
    waiting) then give what a fault-free run gives; nothing is held."""
    requests = [{"input_ids": p, "request_id": f"r{i}"} for i, p in enumerate(prompts()[:4])]
    clean = run_requests(KVMixManager(model, "kivi2", 1e8, max_new_tokens=NEW),
                         [dict(r) for r in requests])
    fired, admit = [], KVMixPagedCache.can_store_request_tokens

    def failing(cache, state, request_len, dry_run=False):
        if state.request_id == "r2" and not fired:
            fired.append(True)
            raise ZeroDivisionError("injected at admission")
        return admit(cache, state, request_len, dry_run)

    monkeypatch.setattr(KVMixPagedCache, "can_store_request_tokens", failing)
    manager = KVMixManager(model, "kivi2", 1e8, max_new_tokens=NEW)
    results = run_requests(manager, [dict(r) for r in requests])
    assert fired
    assert [results[r].error for r in ("r0", "r1")] == ["ZeroDivisionError: injected at "
                                                        "admission"] * 2
    for rid in ("r2", "r3"):
        assert results[rid].error is None
        assert results[rid].generated_tokens == clean[rid].generated_tokens, rid
    assert manager.stats.snapshot()["faulted_requests"] == 2
    assert_nothing_held(manager)


def poison(manager, request_id: str, tokens: int, at: int = -1) -> None:
    """NaN into the keys of layer 1 of ``request_id``'s ``at``-th new token in the forward
    where it holds ``tokens`` tokens."""
    def hook(module, inputs, output):  # output: [1, T, H * D], the flat batch
        if manager.batch_processor is None:  # generate on the same model: not served
            return output
        start = 0
        for rid, past, length in manager.batch_processor.cache._entries:
            if rid == request_id and past == tokens:
                output[0, start + at % length] = float("nan")
            start += length
        return output

    manager.model.model.layers[1].self_attn.k_proj.register_forward_hook(hook)


@pytest.mark.parametrize("joining", [False, True])
def test_non_finite_keys_fail_only_their_request(joining):
    """NaN written into one request's keys, at a decode step or in its prompt (which joins
    with others, which wait again): that request fails naming layer 1; the others give what
    they give alone."""
    model = tiny_llama(seed=4)  # its own: the hook stays on it
    method = method_string("kivi2")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    target = prompts()[3]
    poison(manager, "r3", 0 if joining else len(target) + 7, at=2)
    results = run_requests(manager, [{"input_ids": p, "request_id": f"r{i}"}
                                     for i, p in enumerate(prompts())])
    assert "non-finite keys" in results["r3"].error and "layer 1" in results["r3"].error
    assert len(results["r3"].generated_tokens) == (0 if joining else 8)
    for i, prompt in enumerate(prompts()):
        if i != 3:
            assert results[f"r{i}"].generated_tokens == alone(model, method, prompt), i
    assert_nothing_held(manager)


def test_an_error_no_request_is_named_in_fails_its_step_and_the_loop_goes_on(model,
                                                                              monkeypatch):
    """An op raising in the batched decode call: every request of that step fails with the
    cause; the loop lives, and a request sent afterwards is served as alone."""
    from kvmix.runtime.layer import KVMixLayer

    calls, decode = [], KVMixLayer.decode

    def failing(layer, *args):
        calls.append(1)
        if len(calls) == 9:
            raise RuntimeError("out of memory (injected)")
        return decode(layer, *args)

    monkeypatch.setattr(KVMixLayer, "decode", failing)
    method = method_string("kivi2")
    manager = KVMixManager(model, method, 1e8, max_new_tokens=NEW)
    manager.start()
    try:
        for i, p in enumerate(prompts()[:3]):
            manager.add_request(p, request_id=f"r{i}")
        failed = [manager.get_result(timeout=30) for _ in range(3)]
        assert all("out of memory (injected)" in r.error for r in failed)
        manager.add_request(prompts()[4], request_id="after")
        later = manager.get_result(timeout=30)
        assert later.error is None and later.generated_tokens == alone(model, method,
                                                                       prompts()[4])
        assert manager.is_running()
    finally:
        manager.stop(block=True)
    assert_nothing_held(manager)
