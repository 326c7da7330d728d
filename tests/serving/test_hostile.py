"""``kvmix serve`` under hostile input, as an attacker or a buggy client sends it: every
oversized, out-of-range or malformed request gets a 4xx naming what is wrong, while a watcher
sees ``/health`` answer throughout, and a greedy request afterwards gives what it gave before.
One server per module on a free port of 127.0.0.1, every request bounded in time."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from conftest import idle, served_llama, serving

from kvmix.models.loading import load_tokenizer

TIMEOUT = 60.0
HEALTH_TIMEOUT = 5.0  # a /health slower than this counts as stalled
PROBE = {"prompt": "The capital of France is", "max_tokens": 12}

HOSTILE = [  # (body, what the error says: the field, and what is wrong with the form sent)
    ({"prompt": "a", "top_k": 2**31, "temperature": 1.0}, "top_k"),
    ({"prompt": "a", "top_k": 10**6, "temperature": 1.0}, "top_k"),
    ({"prompt": [1, -5, 3]}, "prompt.1: Input should be greater than or equal to 0"),
    ({"prompt": [[1, 2], [3, 2**40]]}, "prompt.1.1: Input should be less than or equal"),
    ({"prompt": "a", "stop": "x" * (1 << 20)}, "stop"),
    ({"prompt": "a", "stop": ["y" * 100_000]}, "stop.0: String should have at most 256"),
    ({"prompt": "a", "stop": ["x"] * 5}, "stop: List should have at most 4 items"),
    ({"prompt": "a", "stop": 5}, "stop: expected a string or a list of at most 4 strings"),
    ({"prompt": "a", "stop_token_ids": list(range(1000))}, "stop_token_ids"),
    ({"prompt": ["a"] * 100_000}, "prompt: List should have at most 64 items"),
    ({"prompt": {"text": "a"}}, "prompt: expected a string, a list of token ids, or a list"),
    ({"prompt": ["a"] * 16, "n": 8, "temperature": 1.0}, "sequences"),
    ({"prompt": "a", "max_tokens": 2**63}, "max_tokens"),
    ({"prompt": "a", "min_tokens": 2**40}, "min_tokens"),
    ({"prompt": "a", "seed": 2**70}, "seed"),
    ({"prompt": "a", "temperature": 1e308 * 10}, "temperature"),
    ({"prompt": "a", "logit_bias": {str(i): 1.0 for i in range(10_000)}}, "logit_bias"),
    ({"prompt": "a", "logit_bias": {"1": float("nan")}}, "logit_bias"),
    ({"prompt": "a", "presence_penalty": -1e30}, "presence_penalty"),
    ({"prompt": "a", "user": "u" * 10_000}, "user"),
    ({"prompt": "word " * 200_000}, "positions"),
    ({"prompt": "a", "metadata": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {"h": {
        "i": {"j": {"k": {"l": {"m": {"n": {"o": {"p": {"q": 1}}}}}}}}}}}}}}}}}}, "nests"),
]


@pytest.fixture(scope="module")
def served():
    tokenizer = load_tokenizer("smollm2")
    with serving(served_llama(tokenizer), tokenizer) as (manager, server):
        yield manager, server.url


class Watcher:
    """``/health`` asked every 20 ms in a thread of its own; ``stalls`` the checks that did
    not answer 200 within ``HEALTH_TIMEOUT``."""

    def __init__(self, url: str):
        self.url, self.stalls, self.checks = url, [], 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        with httpx.Client(base_url=self.url, timeout=HEALTH_TIMEOUT) as http:
            while not self.done.is_set():
                start = time.monotonic()
                try:
                    status = http.get("/health").status_code
                except httpx.HTTPError as error:
                    status = type(error).__name__
                self.checks += 1
                if status != 200:
                    self.stalls.append((status, time.monotonic() - start))
                time.sleep(0.02)

    def __enter__(self) -> Watcher:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join(HEALTH_TIMEOUT * 2)


def post_raw(url: str, content: bytes, headers: dict | None = None) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        return http.post("/v1/completions", content=content,
                         headers={"content-type": "application/json", **(headers or {})})


def test_hostile_bodies_get_400_while_health_answers(served):
    """Each hostile body: 400 naming the field; /health answers throughout; the probe's greedy
    text afterwards is the text before; nothing of any request stays in the pool."""
    manager, url = served
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        before = http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]
        with Watcher(url) as watcher:
            for body, name in HOSTILE:
                answer = http.post("/v1/completions", content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json"})
                assert answer.status_code == 400, (name, answer.text[:300])
                assert name in answer.json()["error"]["message"], (name, answer.text[:300])
        assert watcher.checks > 0 and not watcher.stalls, watcher.stalls
        assert http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"] == before
    idle(manager)


def test_malformed_bytes_get_4xx_and_the_server_goes_on(served):
    """Nesting far beyond Python's recursion limit, NaN and Infinity literals, invalid UTF-8
    and a 100 kB header: each a 4xx, never a 500 or a closed port; the probe still answers."""
    manager, url = served
    deep = b'{"prompt": "a", "metadata": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    for content, word in [(deep, "deep"), (b'{"prompt": "a", "temperature": NaN}', "temperature"),
                          (b'{"prompt": "a", "top_p": Infinity}', "top_p"),
                          (b'{"prompt": "\xff\xfe"}', "JSON")]:
        answer = post_raw(url, content)
        assert answer.status_code == 400 and word in answer.json()["error"]["message"], \
            (content[:40], answer.text[:300])
    header = post_raw(url, json.dumps(PROBE).encode(), {"x-junk": "j" * 100_000})
    assert 400 <= header.status_code < 500
    assert post_raw(url, json.dumps(PROBE).encode()).status_code == 200
    idle(manager)


def test_penalised_requests_beside_plain_ones_leave_them_as_they_were(served):
    """Requests with every sampling field real clients send (penalties, bias, min_p,
    min_tokens) run beside greedy ones: the greedy ones give their text alone; each penalised
    one gives at least its min_tokens."""
    manager, url = served
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        alone = http.post("/v1/completions", json=PROBE).json()["choices"][0]["text"]
        odd = {"prompt": "Once upon a time", "max_tokens": 10, "temperature": 0.8, "seed": 2,
               "presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.2,
               "min_p": 0.05, "logit_bias": {"2": -100, "198": 5}, "min_tokens": 10,
               "n": 2, "ignore_eos": False}
        threads, answers = [], {}

        def send(key: str, body: dict) -> None:
            answers[key] = http.post("/v1/completions", json=body)

        for i in range(3):
            threads += [threading.Thread(target=send, args=(f"odd{i}", odd)),
                        threading.Thread(target=send, args=(f"plain{i}", PROBE))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(TIMEOUT)
    for key, answer in answers.items():
        assert answer.status_code == 200, answer.text
        if key.startswith("plain"):
            assert answer.json()["choices"][0]["text"] == alone
        else:
            assert answer.json()["usage"]["completion_tokens"] == 20
    assert len(answers) == 6
    idle(manager)


def test_a_body_far_beyond_max_body_is_answered_413_not_reset(served):
    """A 20 MB body, declared or chunked, is read and dropped after the refusal, so the client
    reads the 413 naming the limit instead of a connection reset mid-send."""
    manager, url = served
    body = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'
    for content in (body, iter([body[i : i + (1 << 20)] for i in range(0, len(body), 1 << 20)])):
        answer = post_raw(url, content)
        assert answer.status_code == 413 and "max_body=" in answer.json()["error"]["message"]
    assert post_raw(url, json.dumps(PROBE).encode()).status_code == 200
    idle(manager)
