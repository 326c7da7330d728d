"""vLLM's OpenAI server with kvmix's backend, on 127.0.0.1 (a free port), a bounded number of
requests with timeouts, stopped by the test: its completions are the engine's."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("vllm")

from engines import engine, greedy, prompts, tiny_model_folder

METHOD = {"method": "kivi2"}
START_TIMEOUT = 240  # seconds: vLLM's server starts in about a minute on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    with tiny_model_folder() as folder:
        port = free_port()
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", folder,
                   "--dtype", "float32", "--enforce-eager",
                   "--host", "127.0.0.1", "--port", str(port), "--block-size", "32",
                   "--max-model-len", "512", "--gpu-memory-utilization", "0.5",
                   "--additional-config", json.dumps({"kvmix": METHOD})]
        env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
        process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT
            while time.monotonic() < deadline and process.poll() is None:
                try:
                    urllib.request.urlopen(f"{base}/health", timeout=2).close()
                    break
                except OSError:
                    time.sleep(1)
            else:
                process.kill()
                pytest.fail(f"vLLM's server did not start: {process.stderr.read()[-3000:]}")
            yield folder, base
        finally:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def test_completions_are_the_engines_tokens_with_logprobs_and_n(server):
    folder, base = server
    ids = prompts([45, 70], seed=8)
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
