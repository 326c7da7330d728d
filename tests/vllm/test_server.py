"""vLLM's OpenAI server with kvmix's backend, on 127.0.0.1 (a free port), a bounded number of
requests with timeouts, stopped by the test: its completions are the engine's."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from engines import GIB, engine, greedy, prompts, tiny_model_folder

from kvmix.engines.vllm.server import VllmServer

METHOD = {"method": "kivi2"}
START_TIMEOUT = 240  # seconds: vLLM's server starts in about a minute on 2 cores


def post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as error:
        return error.code, json.load(error)


@pytest.fixture(scope="module")
def server():
    """vLLM's server on the tiny model, as ``kvmix loadtest`` starts it for a ``vllm:`` row
    (1 GiB of KV cache, blocks of 32 tokens), at most 8 requests and 64 tokens a step (a longer
    prompt is prefilled in chunks) -> (folder, URL, the server)."""
    with tiny_model_folder() as folder, tempfile.TemporaryDirectory() as logs:
        served = VllmServer(sys.executable, folder, f"vllm:{METHOD['method']}", GIB, 512,
                            Path(logs) / "server.log", sequences=8,
                            extra=["--block-size", "32", "--max-num-batched-tokens", "64"])
        served.timeout = START_TIMEOUT
        with served as base:
            yield folder, base, served
        assert not os.path.exists(served.temp)  # vLLM's sockets and files went with it


def test_completions_are_the_engines_tokens_with_logprobs_and_n(server):
    """Greedy completions with logprobs (the longest prompt prefilled in chunks of the server's
    64 tokens, whole by the engine), then n=2 sampled: the engine's tokens; vLLM's cache
    holds what 1 GiB less the plugin's staging holds in the engine (its tokens, as the server
    logs them)."""
    folder, base, served = server
    ids = prompts([45, 70, 300], seed=8)
    answers = []
    for request in ids:
        status, body = post(f"{base}/v1/completions", {
            "model": folder, "prompt": request["prompt_token_ids"], "max_tokens": 12,
            "temperature": 0, "logprobs": 2, "return_token_ids": True, "ignore_eos": True})
        assert status == 200, body
        choice = body["choices"][0]
        assert len(choice["token_ids"]) == 12 and body["usage"]["completion_tokens"] == 12
        assert all(p <= 0 for p in choice["logprobs"]["token_logprobs"])
        answers.append(choice["token_ids"])
    status, body = post(f"{base}/v1/completions", {
        "model": folder, "prompt": ids[0]["prompt_token_ids"], "max_tokens": 6, "n": 2,
        "temperature": 0.8, "seed": 3, "return_token_ids": True})
    assert status == 200 and len(body["choices"]) == 2, body
    with engine(folder, METHOD, block_size=32, max_model_len=512) as llm:
        assert greedy(llm, ids, tokens=12) == answers
        blocks = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    # the server's pages hold the budget less the plugin's staging, in the engine's blocks
    assert served.staging > 0 and served.memory + served.staging == GIB
    assert abs(served.reported_tokens / 32 - blocks * served.memory / GIB) <= 1
    assert 0 < served.startup_s < START_TIMEOUT  # measured: spawn to /health
    assert os.listdir(served.temp)  # vLLM's sockets are in a folder of the server's own
    log = served.log.read_text(errors="replace")  # the model in the engine core's process
    assert "(EngineCore pid=" in log and "(Worker pid=" not in log


def test_kvmix_loadtests_client_runs_against_vllms_server(server):
    """``kvmix loadtest``'s client: four streamed requests, two at a time, each exactly its
    tokens; vLLM's running gauge is found in /metrics."""
    from kvmix.bench.load import run_level

    _, base, _ = server
    texts = [" ".join(f"t{i}" for i in range(5 + k, 40 + k)) for k in range(4)]
    outcomes, _, peaks = asyncio.run(run_level(base, texts, [8, 5], 2, 60.0))
    assert [o.error for o in outcomes] == [None] * 4
    assert [o.tokens for o in outcomes] == [8, 5, 8, 5]
    assert len({o.prompt_tokens for o in outcomes}) == 1 and outcomes[0].prompt_tokens >= 35
    # the gauge the loadtest reads for "most running" (too short a run to catch it nonzero)
    assert 0 <= peaks["vllm:num_requests_running"] <= 2


OPTIONS = {  # request options of vLLM's OpenAI server, each with what a well-formed answer has
    "n=3 sampled with a seed": {"n": 3, "temperature": 1.0, "seed": 5},
    "beam search": {"use_beam_search": True, "n": 2, "temperature": 0},
    "logprobs and prompt_logprobs": {"logprobs": 3, "prompt_logprobs": 2, "temperature": 0},
    "stop with min_tokens": {"min_tokens": 4, "temperature": 0},  # the stop: see below
    "penalties": {"presence_penalty": 1.0, "frequency_penalty": 0.5,
                  "repetition_penalty": 1.2, "temperature": 0.7, "seed": 1},
}  # structured output is not here: on the tiny model's word-level tokenizer, xgrammar rejects
# the tokens of stock vLLM's own cache too (and ends the request)


@pytest.mark.parametrize("option", OPTIONS)
def test_every_request_option_gives_a_well_formed_answer(server, option):
    """Each request option of vLLM's OpenAI server through kvmix's cache: the choices it asks
    for, each with its tokens and text; logprobs for every token asked; stop strings honoured
    only from the ``min_tokens``-th token; a seeded request gives the same answer twice."""
    folder, base, _ = server
    asked = dict(OPTIONS[option])
    body = {"model": folder, "prompt": prompts([40], seed=3)[0]["prompt_token_ids"],
            "max_tokens": 8, "return_token_ids": True}
    greedy = post(f"{base}/v1/completions", {**body, "temperature": 0})[1]["choices"][0]
    if "min_tokens" in asked:  # the greedy answer's 2nd word (held off: min_tokens) and 6th
        asked["stop"] = [greedy["text"].split()[i] for i in (1, 5)]
    body.update(asked)
    status, answer = post(f"{base}/v1/completions", body)
    assert status == 200, answer
    choices = answer["choices"]
    assert len(choices) == asked.get("n", 1)
    for choice in choices:
        assert 1 <= len(choice["token_ids"]) <= 8 and choice["finish_reason"] in ("stop", "length")
        assert len(choice["token_ids"]) >= asked.get("min_tokens", 0)
    if "stop" in asked:  # the greedy text, cut at a stop string after the 4th token
        assert choices[0]["finish_reason"] == "stop" and len(choices[0]["token_ids"]) < 8
        assert greedy["text"].startswith(choices[0]["text"])
    if "logprobs" in asked:
        tops = choices[0]["logprobs"]["top_logprobs"]
        assert len(tops) == len(choices[0]["token_ids"]) and all(len(t) >= 3 for t in tops)
        assert len(choices[0]["prompt_logprobs"]) == len(body["prompt"])
    if "seed" in asked:
        assert post(f"{base}/v1/completions", body)[1]["choices"] == choices


def test_a_stream_aborted_midway_ends_its_request(server):
    """A streamed request of 400 tokens whose client goes away after a few chunks: vLLM stops
    it there (nothing running, far fewer tokens generated, no request finished) and the next
    request is answered."""
    folder, base, _ = server
    body = {"model": folder, "prompt": prompts([30], seed=4)[0]["prompt_token_ids"],
            "max_tokens": 400, "ignore_eos": True, "stream": True}
    request = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    generated, finished = (_metric(base, "vllm:generation_tokens_total"),
                           _metric(base, "vllm:request_success_total"))
    with urllib.request.urlopen(request, timeout=60) as response:
        chunks = [response.readline() for _ in range(4)]
    assert any(line.startswith(b"data: ") for line in chunks)
    for _ in range(100):  # the abort reaches the engine within a few steps
        if _metric(base, "vllm:num_requests_running") == 0:
            break
        time.sleep(0.1)
    time.sleep(1.0)  # what it would generate meanwhile, were it running unseen
    assert _metric(base, "vllm:num_requests_running") == 0
    assert _metric(base, "vllm:generation_tokens_total") - generated < 300  # of 400
    assert _metric(base, "vllm:request_success_total") == finished
    status, answer = post(f"{base}/v1/completions", {**body, "stream": False, "max_tokens": 4})
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


def _metric(base: str, name: str, label: str = "") -> float:
    """A counter or gauge of vLLM's /metrics (summed over the lines with ``label``)."""
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(name) and label in line)


LM_EVAL = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvmix-lm-eval"
API_CLIENT = LM_EVAL.is_file() and subprocess.run(
    [str(LM_EVAL.parent / "python"), "-c", "import lm_eval.models.api_models, tenacity"],
    capture_output=True).returncode == 0


@pytest.mark.skipif(not API_CLIENT, reason="kvmix's own environment with the eval extra is "
                    "not built")
def test_lm_evals_local_completions_scores_a_task_through_kvmixs_cache(server):
    """The documented command (docs/guide/vllm.md): lm-eval's own ``local-completions`` model
    against vLLM's server with kvmix's cache, on kvmix's passkey task at 256 tokens: it scores
    the task's three prompts, every one of them computed by the server."""
    folder, base, _ = server
    before = _metric(base, "vllm:prompt_tokens_total")
    metadata = {"max_seq_lengths": [256], "samples": 1, "tokenizer": folder}
    done = subprocess.run(
        [str(LM_EVAL), "--model", "local-completions", "--model_args",
         f"model={folder},base_url={base}/v1/completions,tokenizer={folder},"
         "tokenized_requests=True,max_length=512", "--tasks", "kvmix_passkey",
         "--metadata", json.dumps(metadata)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    row = next(line for line in done.stdout.splitlines() if line.startswith("|kvmix_passkey"))
    assert 0 <= float(row.split("|")[7]) <= 1  # acc
    assert _metric(base, "vllm:prompt_tokens_total") - before >= 3 * 200
