"""``kvmix serve`` with real HTTP clients on the loopback address: a small random model with the
default model's tokenizer, one server per module on a free port of 127.0.0.1, every request
bounded in time; after every test no page of a finished request is left in the pool."""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import time

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvmix
from kvmix.cli import main
from kvmix.models.loading import load_tokenizer
from kvmix.serving.paged import KVMixManager
from kvmix.serving.server import Server, build_app

METHOD = "kivi2:sink=4,residual=16,group=8"
NEW = 24
TIMEOUT = 60.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "import numpy as np\n", "Water boils at", "The quick brown fox jumps over",
           "1, 2, 3, 4,", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def model(tokenizer):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def served(model, tokenizer):
    """(manager, base url): the server on 127.0.0.1, a free port, stopped after the module."""
    budget = KVMixManager(model, METHOD, 1e9).budget
    memory = 4 * budget.footprint(200) + budget.static  # four requests of 200 tokens at once
    manager = KVMixManager(model, METHOD, memory, max_new_tokens=NEW, length=200)
    server = Server(build_app(manager, tokenizer, "tiny", NEW), "127.0.0.1", 0)
    manager.start()
    server.start()
    try:
        yield manager, server.url
    finally:
        server.stop()
        manager.stop(block=True)


@pytest.fixture
def client(served):
    manager, url = served
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http
    idle(manager)
    for layer in manager.cache.layers:  # nothing of a finished request stays
        assert layer.store.batch == 0 and layer.pool.used == 0
    assert not manager.cache.reserved


def idle(manager, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while manager.stats.snapshot()["running"] or manager.cache.rows:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)


def alone(model, tokenizer, prompt: str) -> str:
    """What generate gives the prompt alone with the same method (greedy), on a copy of the
    served model (make_cache routes a model's attention to generate's)."""
    model = copy.deepcopy(model)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, cache=kvmix.make_cache(model, METHOD), max_new_tokens=NEW,
                             do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_eight_concurrent_requests_return_what_each_gets_alone(served, client, model,
                                                                tokenizer):
    """Eight completions at once through a real HTTP client, more than the budget runs at
    once: each text is the solo greedy one."""
    _, url = served

    async def send_all():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "max_tokens": NEW}) for p in PROMPTS))

    answers = asyncio.run(send_all())
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    texts = [a.json()["choices"][0]["text"] for a in answers]
    assert texts == [alone(model, tokenizer, p) for p in PROMPTS]
    assert all(a.json()["usage"]["completion_tokens"] <= NEW for a in answers)


def test_a_streamed_completion_is_the_non_streamed_text(client):
    body = {"prompt": PROMPTS[2], "max_tokens": NEW, "ignore_eos": True}
    whole = client.post("/v1/completions", json=body).json()
    chunks = []
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == whole["choices"][0]["text"] and len(chunks) > 2
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == NEW  # ignore_eos: exactly max_tokens


def test_chat_completions_stream_and_agree(client):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200
    deltas = []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"]
                deltas += [d["delta"].get("content") or "" for d in delta]
    assert "".join(deltas) == whole.json()["choices"][0]["message"]["content"]


def test_what_cannot_be_served_gets_a_4xx_naming_the_limit(client):
    long = " ".join(["word"] * 1100)
    cases = [
        ({"prompt": long, "max_tokens": 8}, "1024 positions"),
        ({"prompt": PROMPTS[0], "max_tokens": 1000}, "beyond the budget memory="),
        ({"prompt": PROMPTS[0], "n": 2}, "n=2 is not served"),
        ({"prompt": PROMPTS[0], "temperature": 0.8}, "temperature=0.8 is not served"),
        ({"prompt": PROMPTS[0], "logprobs": 3}, "logprobs=3 is not served"),
        ({"prompt": PROMPTS[0], "stop": ["\n"]}, "stop="),
        ({"prompt": PROMPTS[0], "model": "other"}, "pinned to 'tiny'"),
    ]
    for body, message in cases:
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 400, body
        assert message in answer.json()["detail"], answer.json()


def test_malformed_json_gets_400(client):
    answer = client.post("/v1/completions", content=b'{"prompt": "a",',
                         headers={"content-type": "application/json"})
    assert answer.status_code == 400 and "JSON" in answer.text


def test_a_client_that_leaves_mid_stream_frees_its_pages(served, client):
    """The stream is closed after 40 chunks (pages sealed by then): the request is cancelled,
    and every layer's pages are free again."""
    manager, _ = served
    idle(manager)
    tokens = manager.stats.snapshot()["output_tokens"]
    body = {"prompt": PROMPTS[1], "max_tokens": 600, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as stream:
        chunks = (line for line in stream.iter_lines() if line.startswith("data: "))
        for _ in range(40):
            next(chunks)
        assert manager.cache.rows  # it is running
        used = [layer.pool.used for layer in manager.cache.layers]
    idle(manager)
    assert manager.stats.snapshot()["output_tokens"] - tokens < 300  # cancelled, not finished
    assert sum(used) > 0  # it held pages; now none is in use
    assert all(len(layer.pool.free) == layer.pool.capacity for layer in manager.cache.layers)


def test_models_health_and_metrics(served, client):
    manager, _ = served
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 4})
    text = client.get("/metrics").text
    metrics = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line and not line.startswith("#")}
    assert metrics["kvmix_requests_running"] == 0
    assert metrics["kvmix_pages_used"] == 0
    assert metrics["kvmix_output_tokens_total"] >= 4
    assert metrics["kvmix_time_to_first_token_seconds_count"] >= 1
    assert metrics["kvmix_cache_budget_bytes"] == pytest.approx(manager.budget.memory, rel=1e-5)
    assert metrics["kvmix_cache_bytes"] == manager.cache.kv.nbytes()
    assert client.post("/v1/responses", json={}).status_code == 404  # not offered here


def test_a_bad_method_or_model_fails_before_the_port_opens(monkeypatch, capsys):
    """Refused at startup with exit status 2 naming the valid ones; the port stays free."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for argv, message in ((["--method", "kivi9"], "valid methods"),
                          (["--model", "/no/such/model"], "valid: 'smollm2'"),
                          (["--memory", "lots"], "memory='lots'")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--port", str(port), *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # never taken


def test_the_load_generator_times_every_request_it_sends(served, client):
    """kvmix loadtest's client against the loopback server: four streamed requests, two at a
    time, each exactly its tokens; the summary is made of those timings."""
    from kvmix.evaluation.loadtest import quantile, run_level, summary

    manager, url = served
    outcomes, wall, peaks = asyncio.run(run_level(url, PROMPTS[:4], 32, 2, TIMEOUT))
    assert [o.error for o in outcomes] == [None] * 4 and {o.tokens for o in outcomes} == {32}
    assert all(o.start < o.first < o.end and o.per_token > 0 for o in outcomes)
    row = summary(outcomes, wall)
    assert row["failures"] == 0 and row["output_tokens_per_s"] == pytest.approx(4 * 32 / wall)
    assert row["ttft_p50_s"] == pytest.approx(quantile([o.ttft for o in outcomes], 0.5))
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < wall
    assert peaks["kvmix_cache_budget_bytes"] == pytest.approx(manager.budget.memory, rel=1e-5)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and quantile([1.0], 0.99) == 1.0


def test_loadtest_refuses_bad_levels_before_any_work(capsys):
    for argv, message in ((["--concurrency", "1,8", "--requests", "1,2,3"], "one per"),
                          (["--concurrency", "0"], "concurrency=[0]")):
        with pytest.raises(SystemExit) as exit_:
            main(["loadtest", "--url", "http://127.0.0.1:9", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
