"""``kvmix serve`` with real HTTP clients on the loopback address (httpx, and the official
``openai`` package where the test is about what it sends): a small random model with the default
model's tokenizer, one server per module on a free port of 127.0.0.1 (a few more, each with the
limits it tests), every request bounded in time; after every test no page of a finished request
is left in the pool."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from conftest import SERVED_METHOD, SERVED_NEW, idle, served_llama, serving, slowed
from prometheus_client.parser import text_string_to_metric_families

import kvmix
from kvmix.cli import main
from kvmix.models.loading import load_tokenizer
from kvmix.serving.server import Limits

METHOD, NEW = SERVED_METHOD, SERVED_NEW
TIMEOUT = 60.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land",
           "import numpy as np\n", "Water boils at", "The quick brown fox jumps over",
           "1, 2, 3, 4,", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def model(tokenizer):
    return served_llama(tokenizer)


@pytest.fixture(scope="module")
def served(model, tokenizer):
    """(manager, base url) of the module's server."""
    with serving(model, tokenizer) as (manager, server):
        yield manager, server.url


@pytest.fixture
def client(served):
    manager, url = served
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        yield http
    idle(manager)


def alone_ids(model, prompt: list[int], new: int = NEW) -> list[int]:
    """The tokens generate gives the prompt alone with the same method (greedy), on a copy of
    the served model (make_cache routes a model's attention to generate's)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), cache=kvmix.make_cache(model, METHOD),
                             max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def alone(model, tokenizer, prompt: str | list[int], new: int = NEW) -> str:
    ids = prompt if isinstance(prompt, list) else tokenizer(prompt).input_ids
    return tokenizer.decode(alone_ids(model, ids, new), skip_special_tokens=True)


def stream_chunks(http: httpx.Client, path: str, body: dict) -> list[dict]:
    chunks = []
    with http.stream("POST", path, json={**body, "stream": True}) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def streamed_text(chunks: list[dict], chat: bool = False) -> str:
    parts = [c["choices"][0]["delta"].get("content", "") if chat else c["choices"][0]["text"]
             for c in chunks if c.get("choices")]
    return "".join(parts)


def metrics(http: httpx.Client) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, through prometheus_client's parser: (name, labels) -> value."""
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
            s.value for family in text_string_to_metric_families(http.get("/metrics").text)
            for s in family.samples}


# -- what a request gets --------------------------------------------------------------------------

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
    chunks = stream_chunks(client, "/v1/completions",
                           {**body, "stream_options": {"include_usage": True}})
    assert streamed_text(chunks) == whole["choices"][0]["text"] and len(chunks) > 2
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == NEW
    assert whole["usage"]["completion_tokens"] == NEW  # ignore_eos: exactly max_tokens
    plain = stream_chunks(client, "/v1/completions", body)
    assert all("usage" not in c for c in plain)  # usage only when asked, as OpenAI's


def test_chat_completions_stream_and_agree(client):
    body = {"messages": [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": [{"type": "text", "text": "Say hello."}]}],
            "max_tokens": 12}
    whole = client.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200
    chunks = stream_chunks(client, "/v1/chat/completions", body)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert streamed_text(chunks, chat=True) == whole.json()["choices"][0]["message"]["content"]


def test_the_openai_client_gets_an_answer_for_every_parameter(served, client, model,
                                                               tokenizer):
    """The official client, sync and async, streamed and not: sampling, seed, stop, logprobs,
    n, prompt lists, chat logprobs — each answer well formed."""
    _, url = served
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT, max_retries=0)
    out = api.completions.create(model="tiny", prompt=[PROMPTS[0], PROMPTS[1]], max_tokens=8,
                                 temperature=0.7, top_p=0.9, seed=4, n=2, logprobs=2,
                                 stop=["\n\n"])
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.tokens) == len(c.logprobs.top_logprobs) for c in out.choices)
    assert out.usage.prompt_tokens == sum(len(tokenizer(p).input_ids) for p in PROMPTS[:2])
    chat = api.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=6,
        temperature=0.5, seed=1, logprobs=True, top_logprobs=3, stop="zzz")
    assert len(chat.choices[0].logprobs.content[0].top_logprobs) == 3
    assert chat.choices[0].finish_reason in ("stop", "length")
    stream = api.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=8,
                                    stream=True, stream_options={"include_usage": True})
    parts = list(stream)
    assert "".join(p.choices[0].text for p in parts if p.choices) == alone(
        model, tokenizer, PROMPTS[3], 8)
    assert parts[-1].usage.completion_tokens == 8

    async def asynchronous():
        aapi = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", timeout=TIMEOUT,
                                  max_retries=0)
        whole = await aapi.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
        streamed = await aapi.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
            stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in streamed
                        if c.choices])
        return whole.choices[0].message.content, text

    whole, text = asyncio.run(asynchronous())
    assert whole == text
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        api.completions.create(model="tiny", prompt="a", presence_penalty=2.5)
    penalised = api.completions.create(
        model="tiny", prompt=PROMPTS[2], max_tokens=8, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"5": -100}, extra_body={
            "repetition_penalty": 1.2, "min_p": 0.1, "min_tokens": 2})
    assert penalised.usage.completion_tokens >= 2


VLLM_PYTHON = Path(__file__).parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.process
@pytest.mark.skipif(not VLLM_PYTHON.exists(), reason="no .venv-vllm (make vllm)")
@pytest.mark.parametrize("backend", ["openai", "openai-chat"])
def test_vllms_benchmark_client_runs_unmodified(served, client, tokenizer, tmp_path, backend):
    """vLLM's own serving benchmark (``vllm bench serve``: random data, a local tokenizer,
    ``repetition_penalty`` in every completions request) against the server: every request
    completes with the output length it asked for."""
    _, url = served
    tokenizer.save_pretrained(tmp_path)
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    run = subprocess.run(
        [str(VLLM_PYTHON), "-m", "kvmix.vllm.tools.bench", "--backend", backend, "--base-url", url,
         "--endpoint", endpoint, "--model", "tiny", "--tokenizer", str(tmp_path),
         "--dataset-name", "random", "--random-input-len", "32", "--random-output-len", "8",
         "--num-prompts", "6", "--max-concurrency", "3", "--ignore-eos", "--seed", "0",
         "--disable-tqdm"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = dict(line.split(":", 1) for line in run.stdout.splitlines()
                   if line.startswith(("Successful requests", "Failed requests",
                                       "Total generated tokens")))
    assert {k: int(v) for k, v in figures.items()} == {
        "Successful requests": 6, "Failed requests": 0, "Total generated tokens": 48}, \
        run.stdout[-3000:]


def test_a_seeded_request_gives_the_same_text_every_time(served, client):
    """Sampled with a seed: the same text alone, again, and beside three other requests."""
    _, url = served
    body = {"prompt": PROMPTS[5], "max_tokens": NEW, "temperature": 1.0, "top_k": 50,
            "seed": 1234, "ignore_eos": True}
    first = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert client.post("/v1/completions", json=body).json()["choices"][0]["text"] == first

    async def beside():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            others = [http.post("/v1/completions", json={"prompt": p, "max_tokens": NEW,
                                                         "temperature": 0.8})
                      for p in PROMPTS[:3]]
            return await asyncio.gather(http.post("/v1/completions", json=body), *others)

    answers = asyncio.run(beside())
    assert answers[0].json()["choices"][0]["text"] == first
    other = client.post("/v1/completions", json={**body, "seed": 4321}).json()
    assert other["choices"][0]["text"] != first


def test_stop_strings_end_the_text_before_them(client, model, tokenizer):
    """A stop string taken from the middle of the greedy text: the answer is the text before
    it, finish_reason "stop", streamed or not (a stream never shows part of it)."""
    full = alone(model, tokenizer, PROMPTS[6], NEW)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    expected = full[: full.index(stop)]
    body = {"prompt": PROMPTS[6], "max_tokens": NEW, "stop": ["never-there", stop]}
    whole = client.post("/v1/completions", json=body).json()
    assert whole["choices"][0]["text"] == expected
    assert whole["choices"][0]["finish_reason"] == "stop"
    assert whole["usage"]["completion_tokens"] < NEW
    chunks = stream_chunks(client, "/v1/completions", body)
    assert streamed_text(chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_stop_token_ids_end_generation(client, model, tokenizer):
    ids = tokenizer(PROMPTS[4]).input_ids
    tokens = alone_ids(model, ids)
    stop = tokens[5]
    answer = client.post("/v1/completions", json={
        "prompt": ids, "max_tokens": NEW, "stop_token_ids": [stop]}).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"]["completion_tokens"] == tokens.index(stop) + 1


def test_logprobs_in_each_endpoints_format(client, tokenizer):
    """Completions (top 2) and chat (top 3), greedy: one entry per token whose texts make the
    text, each token the most likely of its alternatives, log-probabilities <= 0."""
    answer = client.post("/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 10, "logprobs": 2, "ignore_eos": True}).json()
    choice = choice0 = answer["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] and len(logprobs["tokens"]) == 10
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    assert all(max(top.values()) == pytest.approx(lp, abs=1e-5) for top, lp in
               zip(logprobs["top_logprobs"], logprobs["token_logprobs"], strict=True))
    assert logprobs["text_offset"][0] == 0 and all(lp <= 0 for lp in logprobs["token_logprobs"])
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "logprobs": True,
        "top_logprobs": 3, "ignore_eos": True}).json()["choices"][0]
    content = chat["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == chat["message"]["content"]
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"]
               and c["bytes"] and c["top_logprobs"][0]["bytes"] == c["bytes"] for c in content)
    whole = b"".join(bytes(c["bytes"]) for c in content)  # a character's parts joined
    assert whole.decode(errors="ignore") == chat["message"]["content"]
    plain = client.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 10,
                                                 "ignore_eos": True}).json()["choices"][0]
    assert plain["logprobs"] is None and plain["text"] == choice0["text"]


def test_prompts_as_token_ids_and_lists(client, model, tokenizer):
    """A prompt of token ids answers as its text does; a list of prompts gets one choice each,
    in order, each its solo text."""
    ids = tokenizer(PROMPTS[1]).input_ids
    by_ids = client.post("/v1/completions", json={"prompt": ids, "max_tokens": NEW}).json()
    assert by_ids["choices"][0]["text"] == alone(model, tokenizer, PROMPTS[1])
    several = client.post("/v1/completions", json={"prompt": PROMPTS[:2], "max_tokens": NEW})
    texts = [c["text"] for c in sorted(several.json()["choices"], key=lambda c: c["index"])]
    assert texts == [alone(model, tokenizer, p) for p in PROMPTS[:2]]
    lists = client.post("/v1/completions", json={
        "prompt": [ids, tokenizer(PROMPTS[0]).input_ids], "max_tokens": NEW}).json()
    assert [c["text"] for c in lists["choices"]] == [texts[1], texts[0]]


def test_n_sampled_choices(client):
    answer = client.post("/v1/completions", json={
        "prompt": PROMPTS[2], "max_tokens": NEW, "n": 3, "temperature": 1.0, "seed": 9,
        "ignore_eos": True}).json()
    texts = [c["text"] for c in answer["choices"]]
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2] and len(set(texts)) == 3
    assert answer["usage"]["completion_tokens"] == 3 * NEW
    again = client.post("/v1/completions", json={
        "prompt": PROMPTS[2], "max_tokens": NEW, "n": 3, "temperature": 1.0, "seed": 9,
        "ignore_eos": True}).json()
    assert [c["text"] for c in again["choices"]] == texts


MALFORMED = [
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": 5}, "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "n": 9, "temperature": 1}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 2}, "n=2"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "a", "frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"prompt": "a", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "a", "min_tokens": 100, "max_tokens": 8}, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "top_k": 2**31}, "top_k"),
    ("/v1/completions", {"prompt": "a", "top_k": 10**6, "temperature": 1}, "top_k"),
    ("/v1/completions", {"prompt": [1, -5, 3]}, "prompt"),
    ("/v1/completions", {"prompt": "a", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": "a", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": "a", "suffix": "b"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "colour": "red"}, "colour"),
    ("/v1/completions", {"prompt": {"text": "a"}}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**6]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}},
     "stream_options"),
    ("/v1/completions", {"prompt": "a", "model": "other"}, "pinned to 'tiny'"),
    ("/v1/completions", {"prompt": "a", "seed": "x"}, "seed"),
    ("/v1/completions", {"max_tokens": 3}, "prompt is required"),
    ("/v1/completions", ["a"], "JSON object"),
    ("/v1/completions", {"prompt": " ".join(["word"] * 1100), "max_tokens": 8},
     "1024 positions"),
    ("/v1/completions", {"prompt": "a b", "max_tokens": 1000, "n": 4, "temperature": 1},
     "beyond the budget memory="),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, "role"),
    ("/v1/chat/completions", {"messages": [{"content": "a"}]}, "role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "tools": [{"type": "function"}]}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
]


def test_malformed_fields_get_400_naming_them(client):
    """Wrong types, ranges, unknown fields and roles, refused parameters, sizes that can never
    be served: 400 naming the field (OpenAI's error format), never a 500."""
    for path, body, name in MALFORMED:
        answer = client.post(path, json=body)
        assert answer.status_code == 400, (body, answer.text)
        assert name in answer.json()["error"]["message"], (body, answer.json())
    broken = client.post("/v1/completions", content=b'{"prompt": "a",',
                         headers={"content-type": "application/json"})
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]


def test_client_request_ids_are_echoed_and_never_keys(served, client, caplog):
    """Two requests with the same X-Request-ID at once (a retrying proxy): both answered, the
    header echoed, each with its own id, the client's id logged."""
    _, url = served
    caplog.set_level(logging.INFO, logger="kvmix.serve")

    async def twice():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
            return await asyncio.gather(*(http.post(
                "/v1/completions", json={"prompt": p, "max_tokens": 8},
                headers={"X-Request-ID": "retry-42"}) for p in PROMPTS[:2]))

    answers = asyncio.run(twice())
    assert [a.status_code for a in answers] == [200, 200]
    assert [a.headers["x-request-id"] for a in answers] == ["retry-42"] * 2
    assert len({a.json()["id"] for a in answers}) == 2
    assert sum("retry-42" in r.getMessage() for r in caplog.records) == 2
    assert client.get("/health").json() == {"status": "ok"}


# -- faults ---------------------------------------------------------------------------------------

def test_a_fault_in_one_of_sixteen_requests_fails_it_alone(served, client, model, tokenizer):
    """A hook raises for one request (a prompt of 37 token ids, at its 5th decode step): it gets
    a 500 with the cause, the other fifteen their solo texts, /health stays 200, no page
    leaks; a streamed request with the same fault ends with an error chunk."""
    manager, url = served
    target = list(range(1000, 1037))

    def inject(request_id: str, tokens: int) -> None:
        if tokens == len(target) + 4:
            raise RuntimeError("injected")

    manager.cache.inject = inject
    try:
        prompts = [*(PROMPTS * 2)[:15], target]

        async def sixteen():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as http:
                return await asyncio.gather(*(http.post("/v1/completions", json={
                    "prompt": p, "max_tokens": NEW}) for p in prompts))

        answers = asyncio.run(sixteen())
        assert [a.status_code for a in answers] == [200] * 15 + [500]
        assert "RuntimeError: injected" in answers[-1].json()["error"]["message"]
        solo = {p: alone(model, tokenizer, p) for p in PROMPTS}
        assert [a.json()["choices"][0]["text"] for a in answers[:15]] == \
            [solo[p] for p in prompts[:15]]
        assert client.get("/health").status_code == 200
        chunks = stream_chunks(client, "/v1/completions", {"prompt": target, "max_tokens": NEW})
        assert "injected" in chunks[-1]["error"]["message"]
        assert streamed_text(chunks[:-1]) != ""  # what it generated before the fault came
    finally:
        manager.cache.inject = None
    idle(manager)
    after = metrics(client)
    assert after[("kvmix:request_failure_total", (("cause", "fault"),))] >= 2


# -- limits, access, shutdown ---------------------------------------------------------------------

def test_bodies_beyond_max_body_get_413(model, tokenizer):
    with serving(model, tokenizer, Limits(max_tokens=NEW, max_body=2000)) as (_, server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        big = {"prompt": "word " * 1000}
        assert http.post("/v1/completions", json=big).status_code == 413
        chunked = http.post("/v1/completions", content=iter([json.dumps(big).encode()] * 2),
                            headers={"content-type": "application/json"})
        assert chunked.status_code == 413 and "max_body=2000" in chunked.json()["error"]["message"]
        assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code \
            == 200


def test_a_request_past_its_deadline_gets_504_and_its_pages_return(model, tokenizer):
    with serving(model, tokenizer, Limits(max_tokens=NEW, request_timeout=0.3)) as (manager,
                                                                                   server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http, \
            slowed(manager, 0.05):  # every step 0.05 s at least: past 0.3 s on any machine
        long = {"prompt": PROMPTS[0], "max_tokens": 150, "ignore_eos": True}
        answer = http.post("/v1/completions", json=long)
        assert answer.status_code == 504 and "request_timeout" in answer.json()["error"]["message"]
        chunks = stream_chunks(http, "/v1/completions", long)
        assert "deadline" in chunks[-1]["error"]["message"]
        idle(manager)
        assert manager.stats.snapshot()["output_tokens"] < 2 * 150


def test_tokenization_runs_off_the_event_loop(client, monkeypatch):
    """A long prompt is tokenized in a worker thread, not on the thread that answers /health."""
    from kvmix.serving.server import Service

    threads, encode = [], Service.encode

    def recorded(service, ask):
        threads.append(threading.current_thread().name)
        return encode(service, ask)

    monkeypatch.setattr(Service, "encode", recorded)
    client.post("/v1/completions", json={"prompt": "word " * 400, "max_tokens": 2})
    assert threads and threads[0] != "kvmix-serve"


def test_a_non_streamed_client_that_leaves_is_cancelled(served, client):
    manager, url = served
    idle(manager)
    before = manager.stats.snapshot()["output_tokens"]
    with slowed(manager):  # 170 tokens take over 3 s: the client leaves long before
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url, timeout=0.5) as http:
            http.post("/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 170,
                                               "ignore_eos": True})
        idle(manager)
    assert manager.stats.snapshot()["output_tokens"] - before < 170


def test_a_client_that_leaves_cancels_every_prompt_and_choice_running_or_queued(served):
    """Three prompts of two choices each, more rows than the budget runs at once (a prompt
    waits): the client leaves after a second. Every choice stops, the queued prompt's too (its
    two choices alone would add 340 tokens), and nothing stays held."""
    manager, url = served
    idle(manager)
    assert manager.budget.rows < 6
    before = manager.stats.snapshot()["output_tokens"]
    body = {"prompt": PROMPTS[:3], "n": 2, "max_tokens": 170, "ignore_eos": True,
            "temperature": 0.8}
    with slowed(manager, 0.05):  # a step of 0.05 s at least: 170 tokens take 8.5 s
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url, timeout=1) as http:
            answer = http.post("/v1/completions", json=body)
            pytest.fail(f"answered: {answer.status_code} {answer.text[:300]}")
        idle(manager)
    assert manager.stats.snapshot()["output_tokens"] - before < 2 * 170


def test_a_client_that_leaves_mid_stream_frees_its_pages(served, client):
    """The stream is closed after 40 chunks (pages sealed by then): the request is cancelled,
    every layer's pages are free again, and /metrics counts a client that went away."""
    manager, _ = served
    idle(manager)
    tokens = manager.stats.snapshot()["output_tokens"]
    left = metrics(client).get(("kvmix:request_failure_total", (("cause", "disconnected"),)), 0)
    body = {"prompt": PROMPTS[1], "max_tokens": 170, "ignore_eos": True, "stream": True}
    with slowed(manager), client.stream("POST", "/v1/completions", json=body) as stream:
        chunks = (line for line in stream.iter_lines() if line.startswith("data: "))
        for _ in range(40):
            next(chunks)
        assert manager.cache.rows  # it is running
        used = [layer.pool.used for layer in manager.cache.layers]
    idle(manager)
    assert manager.stats.snapshot()["output_tokens"] - tokens < 150  # cancelled, not finished
    assert sum(used) > 0  # it held pages; now none is in use
    assert metrics(client)[("kvmix:request_failure_total", (("cause", "disconnected"),))] == \
        left + 1


def test_an_api_key_guards_v1_but_not_health_or_metrics(model, tokenizer):
    with serving(model, tokenizer, Limits(max_tokens=NEW, api_key="sekret")) as (_, server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        assert http.get("/v1/models").status_code == 401
        assert http.post("/v1/completions", json={"prompt": "a"},
                         headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert http.get("/v1/models", headers={"Authorization": "Bearer sekret"}).json()[
            "data"][0]["id"] == "tiny"
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sekret", max_retries=0)
        assert api.completions.create(model="tiny", prompt="a", max_tokens=3).choices
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="no", max_retries=0
                          ).completions.create(model="tiny", prompt="a", max_tokens=3)


def test_a_drain_refuses_new_requests_and_finishes_running_ones(model, tokenizer):
    """drain() (what SIGTERM calls): a running stream completes; a new request gets 503 and
    /health 503; then the server stops with exit code 0."""
    with serving(model, tokenizer, Limits(max_tokens=NEW, drain_timeout=60)) as (_, server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        body = {"prompt": PROMPTS[0], "max_tokens": 150, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            server.service.drain()
            refused = http.post("/v1/completions", json={"prompt": "a"})
            assert refused.status_code == 503 and http.get("/health").status_code == 503
            rest = [json.loads(line[6:]) for line in lines
                    if line.startswith("data: ") and line != "data: [DONE]"]
        assert rest[-1]["usage"]["completion_tokens"] == 150
        server.thread.join(10)
        assert not server.thread.is_alive() and server.service.exit_code == 0


def test_a_drain_waits_for_a_request_still_being_tokenized(model, tokenizer, monkeypatch):
    """A request that arrived before the drain but is still in its tokenizer (a slow one
    here) is answered in full before the server stops."""
    from kvmix.serving.server import Service

    entered, encode = threading.Event(), Service.encode

    def slow(service, ask):
        entered.set()
        time.sleep(1.0)
        return encode(service, ask)

    monkeypatch.setattr(Service, "encode", slow)
    answers = []
    with serving(model, tokenizer, Limits(max_tokens=NEW, drain_timeout=60)) as (_, server), \
            httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
        sender = threading.Thread(target=lambda: answers.append(http.post(
            "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 6,
                                     "ignore_eos": True})))
        sender.start()
        assert entered.wait(TIMEOUT)
        server.service.drain()
        time.sleep(0.3)  # the drain's watch looks every 50 ms
        assert server.service.exit_code is None  # it waits for the request
        sender.join(TIMEOUT)
        server.thread.join(10)
        assert not server.thread.is_alive() and server.service.exit_code == 0
    assert answers[0].status_code == 200, answers[0].text
    assert answers[0].json()["usage"]["completion_tokens"] == 6


def test_a_dead_loop_stops_the_server_with_exit_code_1(model, tokenizer):
    """The loop dies under a request: that request fails (a fault or a refusal, never counted
    as draining) and the server stops with exit code 1."""
    with serving(model, tokenizer) as (manager, server):
        deadline = time.monotonic() + TIMEOUT
        while manager.batch_processor is None:  # the loop thread builds it once started
            assert time.monotonic() < deadline, "the loop never built its batch processor"
            time.sleep(0.01)
        working = manager.batch_processor.prepare_next_batch

        def broken():  # once the request is queued: broken before, the server could stop first
            if not manager.input_queue.qsize():
                return working()
            raise RuntimeError("the loop breaks")

        manager.batch_processor.prepare_next_batch = broken
        with httpx.Client(base_url=server.url, timeout=TIMEOUT) as http:
            answer = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 4})
        server.thread.join(10)
        assert not server.thread.is_alive() and server.service.exit_code == 1
        assert answer.status_code in (500, 503)  # failed by the loop, or refused after it
        registry = server.service.metrics.registry
        failed = {cause: registry.get_sample_value("kvmix:request_failure_total", {
            "model_name": "tiny", "cause": cause}) or 0 for cause in
            ("fault", "loop_died", "draining")}
        assert failed["fault"] + failed["loop_died"] == 1 and failed["draining"] == 0


@pytest.mark.process
def test_sigterm_drains_a_real_server_process_then_exits_0(model, tokenizer, tmp_path):
    """``kvmix serve`` as users run it, on a saved tiny model: SIGTERM mid-stream: the stream
    completes, a new request gets 503, the process exits 0."""
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "kvmix.cli", "serve", "--model", str(tmp_path), "--method",
         METHOD, "--memory", "20MB", "--port", str(port), "--fit-prompt", "64",
         "--max-tokens", "24"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, process)
        with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
            body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True,
                    "stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/completions", json=body) as stream:
                lines = stream.iter_lines()
                next(line for line in lines if line.startswith("data: "))
                process.send_signal(signal.SIGTERM)
                time.sleep(0.2)
                assert http.post("/v1/completions", json={"prompt": "a"}).status_code == 503
                rest = [json.loads(line[6:]) for line in lines
                        if line.startswith("data: ") and line != "data: [DONE]"]
            assert rest[-1]["usage"]["completion_tokens"] == 200
        assert process.wait(60) == 0, process.stderr.read().decode()[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def wait_healthy(url: str, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.3)
    raise AssertionError("the server did not come up")


# -- metrics, startup, the load generator ---------------------------------------------------------

def test_models_health_and_metrics(served, client):
    """The gateway gauges and the cache's figures, through prometheus_client's parser; the
    request histograms and counters move as requests end; no /docs or /openapi.json."""
    manager, _ = served
    assert client.get("/health").json() == {"status": "ok"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    assert all(client.get(path).status_code == 404 for path in ("/docs", "/openapi.json"))
    before = metrics(client)
    client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": 4,
                                         "ignore_eos": True})
    client.post("/v1/completions", json={"prompt": PROMPTS[4], "max_tokens": "x"})
    deadline = time.monotonic() + 10  # the gauges are refreshed once the loop's turn has ended
    while True:  # (the response can arrive first)
        after = metrics(client)
        gauge = {name: value for (name, labels), value in after.items() if not labels}
        idle = gauge["kvmix:num_requests_running"] == gauge["kvmix:num_requests_waiting"] == 0
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert idle
    assert gauge["kvmix:kv_cache_usage_perc"] == 0 and gauge["kvmix:pages_used"] == 0
    assert gauge["kvmix:cache_budget_bytes"] == pytest.approx(manager.budget.memory, rel=1e-5)
    assert gauge["kvmix:cache_bytes"] == manager.cache.kv.nbytes()

    def moved(name, labels=()):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert moved("kvmix:generation_tokens_total") == 4
    assert moved("kvmix:time_to_first_token_seconds_count") == 1
    assert moved("kvmix:request_success_total", (("finished_reason", "length"),)) == 1
    assert moved("kvmix:request_failure_total", (("cause", "bad_request"),)) == 1
    assert client.post("/v1/responses", json={}).status_code == 404  # not offered here


def test_kv_usage_counts_what_running_requests_reserve(served, client):
    """The gateway gauge is the share of the budget the running request reserved; the pages
    a router weighs are those it did not reserve, fewer than the pages not in use now."""
    manager, _ = served
    with slowed(manager), client.stream("POST", "/v1/completions", json={
            "prompt": PROMPTS[0], "max_tokens": 150, "ignore_eos": True, "stream": True}) as s:
        lines = s.iter_lines()  # kept: a dropped line iterator, once collected, closes the stream
        first = next(line for line in lines if line.startswith("data: "))
        deadline = time.monotonic() + 10  # the gauge is refreshed once the step has ended
        while (usage := metrics(client)[("kvmix:kv_cache_usage_perc", ())]) == 0 and \
                time.monotonic() < deadline:
            time.sleep(0.02)
        budget = manager.budget
        assert 0 < usage < 1, (first, manager.stats.snapshot(), manager.cache.reserved)
        assert usage == pytest.approx(
            manager.cache.reserved_bytes() / (budget.memory - budget.static), rel=1e-6)
        figures = manager.cache.figures()  # a router weighs the pages no request reserved
        capacity = manager.cache.pools[0] * len(manager.cache.layers)
        assert figures["pages_unreserved"] == capacity - manager.cache.pages_reserved[0] * len(
            manager.cache.layers) < capacity - figures["pages_used"]


def test_a_bad_method_model_or_limit_fails_before_the_port_opens(monkeypatch, capsys):
    """Refused at startup with exit status 2 naming the valid ones; the port stays free."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for argv, message in ((["--method", "kivi9"], "valid methods"),
                          (["--model", "/no/such/model"], "valid: 'smollm2'"),
                          (["--memory", "lots"], "memory='lots'"),
                          (["--max-body", "huge"], "max_body='huge'"),
                          (["--request-timeout", "-1"], "request_timeout=-1"),
                          (["--drain-timeout", "0"], "drain_timeout=0")):
        with pytest.raises(SystemExit) as exit_:
            main(["serve", "--port", str(port), *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", port))  # never taken


def test_the_load_generator_times_every_request_it_sends(served, client):
    """kvmix loadtest's client against the loopback server: four streamed, sampled requests, two
    at a time, each exactly its tokens (32 and 16 in turn); the summary is made of those
    timings; the peaks come from /metrics through prometheus_client's parser."""
    from kvmix.bench.load import quantile, run_level, summary

    manager, url = served
    outcomes, wall, peaks = asyncio.run(run_level(url, PROMPTS[:4], [32, 16], 2, TIMEOUT,
                                                  temperature=0.8))
    assert [o.error for o in outcomes] == [None] * 4
    assert [o.tokens for o in outcomes] == [32, 16, 32, 16]
    assert all(o.start < o.first < o.end and o.per_token > 0 for o in outcomes)
    row = summary(outcomes, wall)
    assert row["failures"] == 0 and row["output_tokens_per_s"] == pytest.approx(96 / wall)
    assert row["ttft_p50_s"] == pytest.approx(quantile([o.ttft for o in outcomes], 0.5))
    assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"] < wall
    assert peaks["kvmix:cache_budget_bytes"] == pytest.approx(manager.budget.memory, rel=1e-5)
    assert quantile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5 and quantile([1.0], 0.99) == 1.0


def test_loadtest_refuses_bad_levels_before_any_work(capsys):
    for argv, message in ((["--concurrency", "1,8", "--requests", "1,2,3"], "one per"),
                          (["--concurrency", "0"], "concurrency=[0]"),
                          (["--new-tokens", "0,8"], "new_tokens=[0, 8]"),
                          (["--temperature", "3"], "temperature=3")):
        with pytest.raises(SystemExit) as exit_:
            main(["loadtest", "--url", "http://127.0.0.1:9", *argv])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
