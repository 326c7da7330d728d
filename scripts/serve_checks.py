"""The serving issue's figures on the default model (issue 32), in one process: a kvmix server on
a free port of 127.0.0.1 and, against it,

1. the official ``openai`` client, sync and async, streamed and not, with every parameter
   ``kvmix serve`` honours (each answer checked for its shape), and malformed bodies (each a 400
   naming the field);
2. ``/health`` polled every 10 ms while another client's 1 MB prompt is tokenized (p50, p99,
   max of its latency);
3. a fault injected into one of 16 running requests (at its 5th decode step): how many complete,
   how many fail, pages left in use, and whether the others' texts are what each gives alone;
4. ``/health`` polled every 10 ms while hostile bodies are refused (a negative token id, a list
   of 100,000 prompts, five stop strings, a 20 MB body): each refusal's status and message.

    .venv/bin/python scripts/serve_checks.py [--method kivi2] [--memory 180MB] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import httpx
import openai
import torch

import kvmix
from kvmix.evaluation.data import prompt_set
from kvmix.models.loading import load_model
from kvmix.serving.paged import KVMixManager
from kvmix.serving.server import Limits, Server, build_app


def client_checks(url: str) -> dict[str, bool]:
    """Each parameter through the official client: True where the answer has the shape the
    parameter asks for."""
    api = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    chat = [{"role": "user", "content": "Name three colours."}]
    checks = {}
    out = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=16,
                                 temperature=0.7, top_p=0.9, seed=7)
    checks["temperature+top_p+seed"] = out.choices[0].finish_reason in ("stop", "length")
    again = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=16,
                                   temperature=0.7, top_p=0.9, seed=7)
    checks["seed reproduces"] = again.choices[0].text == out.choices[0].text
    top_k = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=8,
                                   temperature=1.0, extra_body={"top_k": 1})
    greedy = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=8)
    checks["top_k=1 is greedy"] = top_k.choices[0].text == greedy.choices[0].text
    stop = api.completions.create(model="smollm2", prompt="Count: 1, 2, 3,", max_tokens=32,
                                  stop=[","])
    checks["stop"] = "," not in stop.choices[0].text and stop.choices[0].finish_reason == "stop"
    ids = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=32,
                                 extra_body={"stop_token_ids": [13]})  # "."
    checks["stop_token_ids"] = ids.choices[0].finish_reason in ("stop", "length")
    logprobs = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=8,
                                      logprobs=5)
    checks["logprobs=5"] = all(len(t) == 5 for t in logprobs.choices[0].logprobs.top_logprobs)
    lists = api.completions.create(model="smollm2", prompt=["The sky is", "Water is"],
                                   max_tokens=8)
    checks["prompt list"] = [c.index for c in lists.choices] == [0, 1]
    tokens = api.completions.create(model="smollm2", prompt=[504, 3572, 314], max_tokens=8)
    checks["prompt token ids"] = bool(tokens.choices)
    n = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=8, n=4,
                               temperature=1.0)
    checks["n=4"] = len(n.choices) == 4
    streamed = api.completions.create(model="smollm2", prompt="The sky is", max_tokens=16,
                                      stream=True, stream_options={"include_usage": True})
    parts = list(streamed)
    checks["stream+usage"] = parts[-1].usage.completion_tokens == 16
    c = api.chat.completions.create(model="smollm2", messages=chat, max_completion_tokens=24,
                                    temperature=0.8, seed=3, logprobs=True, top_logprobs=20,
                                    n=2, stop=["\n\n"])
    checks["chat: sampling, logprobs 20, n, stop"] = len(c.choices) == 2 and all(
        len(t.top_logprobs) == 20 for t in c.choices[0].logprobs.content)
    s = api.chat.completions.create(model="smollm2", messages=chat, max_tokens=24, stream=True)
    checks["chat stream"] = bool("".join(p.choices[0].delta.content or "" for p in s
                                         if p.choices))

    async def asynchronous() -> bool:
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none",
                                      max_retries=0) as aapi:
            whole, streamed = await asyncio.gather(
                aapi.chat.completions.create(model="smollm2", messages=chat, max_tokens=16),
                aapi.chat.completions.create(model="smollm2", messages=chat, max_tokens=16,
                                             stream=True))
            text = "".join([p.choices[0].delta.content or "" async for p in streamed
                            if p.choices])
        return text == whole.choices[0].message.content

    checks["async: streamed == whole"] = asyncio.run(asynchronous())
    malformed = {"max_tokens": {"max_tokens": "ten"}, "temperature": {"temperature": -1},
                 "presence_penalty": {"presence_penalty": 1.0}, "n": {"n": 9},
                 "logprobs": {"logprobs": 9}, "colour": {"colour": "red"}}
    for field, extra in malformed.items():
        try:
            api.completions.create(model="smollm2", prompt="a", extra_body=extra)
            checks[f"400 names {field}"] = False
        except openai.BadRequestError as error:
            checks[f"400 names {field}"] = field in str(error)
    try:
        api.chat.completions.create(model="smollm2", messages=[], max_tokens=4)
        checks["400 names messages"] = False
    except openai.BadRequestError as error:
        checks["400 names messages"] = "messages" in str(error)
    return checks


def health_during_a_big_prompt(url: str, size: int = 1 << 20) -> dict[str, float]:
    """/health latency (ms) polled every 10 ms while a ``size``-byte prompt is tokenized, and
    the same polling with nothing else running."""
    idle = _poll_health(url, lambda: time.sleep(1.0))
    start = time.perf_counter()
    answer = {}

    def big() -> None:
        answer["status"] = httpx.post(f"{url}/v1/completions", timeout=600, json={
            "prompt": "lorem ipsum dolor " * (size // 18), "max_tokens": 4}).status_code
        answer["seconds"] = time.perf_counter() - start

    busy = _poll_health(url, big)
    return {"prompt_bytes": size, "status": answer["status"], "request_s": answer["seconds"],
            **{f"busy_{k}": v for k, v in busy.items()},
            **{f"idle_{k}": v for k, v in idle.items()}}


def _poll_health(url: str, during) -> dict[str, float]:
    """/health latency (ms) polled every 10 ms while ``during()`` runs."""
    latencies, done = [], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=10) as http:
            while not done.is_set():
                start = time.perf_counter()
                http.get("/health").raise_for_status()
                latencies.append(1e3 * (time.perf_counter() - start))
                time.sleep(0.01)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(0.2)
    during()
    done.set()
    poller.join()
    ordered = sorted(latencies)
    return {"polls": len(ordered), "p50_ms": statistics.median(ordered),
            "p99_ms": ordered[int(0.99 * (len(ordered) - 1))], "max_ms": ordered[-1]}


HOSTILE = {"negative token id": {"prompt": [1, -5, 3]},
           "100,000 prompts": {"prompt": ["a"] * 100_000},
           "five stop strings": {"prompt": "a", "stop": ["x"] * 5}}


def health_during_hostile_bodies(url: str) -> dict:
    """/health latency (ms) polled every 10 ms while each hostile body is refused, and what
    each refusal says."""
    refusals = {}

    def send() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            bodies = {name: json.dumps(body).encode() for name, body in HOSTILE.items()}
            bodies["20 MB body"] = b'{"prompt": "' + b"a" * (20 << 20) + b'"}'
            for name, content in bodies.items():
                try:
                    answer = http.post("/v1/completions", content=content,
                                       headers={"content-type": "application/json"})
                    refusals[name] = (answer.status_code, answer.json()["error"]["message"][:160])
                except (httpx.HTTPError, ValueError) as error:  # no answer, or not JSON
                    refusals[name] = (type(error).__name__, str(error)[:160])

    return {"refusals": refusals, **_poll_health(url, send)}


def fault_in_one_of_sixteen(url: str, manager, loaded, method: str,
                            prompts: list[list[int]]) -> dict:
    """16 requests at once, one of them failing at its 5th decode step."""
    target, prompt_of = prompts[-1], {}

    def inject(request_id: str, held: int) -> None:
        """``held`` at a request's first decode step is its prompt's length (each its own)."""
        if held and prompt_of.setdefault(request_id, held) == len(target) \
                and held == len(target) + 4:
            raise RuntimeError("injected fault")

    manager.cache.inject = inject

    async def sixteen():
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": p, "max_tokens": 32}) for p in prompts))

    answers = asyncio.run(sixteen())
    manager.cache.inject = None
    time.sleep(1)
    solo = [_alone(loaded, method, p) for p in prompts[:-1]]
    texts = [a.json()["choices"][0]["text"] for a in answers[:-1] if a.status_code == 200]
    return {"completed": sum(a.status_code == 200 for a in answers),
            "failed": sum(a.status_code == 500 for a in answers),
            "failure": answers[-1].json().get("error", {}).get("message"),
            "pages_in_use_after": sum(layer.pool.used for layer in manager.cache.layers),
            "rows_after": len(manager.cache.rows),
            "others_equal_alone": texts == solo}


def _alone(loaded, method: str, prompt: list[int]) -> str:
    with torch.no_grad():
        out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                    cache=kvmix.make_cache(loaded.model, method))
    return loaded.tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="kivi2")
    parser.add_argument("--memory", default="180MB")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    served, reference = load_model(), load_model()  # generate alone on the second copy
    manager = KVMixManager(served.model, args.method, args.memory, max_new_tokens=64)
    server = Server(build_app(manager, served.tokenizer, "smollm2", Limits(max_tokens=64)),
                    "127.0.0.1", 0)
    manager.start()
    server.start()
    try:
        prompts = [p[: 40 + 7 * i] for i, p in
                   enumerate(prompt_set("prose", served.tokenizer, 16, 200))]
        results = {"method": args.method, "memory": args.memory,
                   "client": client_checks(server.url),
                   "health": health_during_a_big_prompt(server.url),
                   "hostile": health_during_hostile_bodies(server.url),
                   "fault": fault_in_one_of_sixteen(server.url, manager, reference, args.method,
                                                    prompts)}
    finally:
        server.stop()
        manager.stop(block=True)
    text = json.dumps(results, indent=2)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "serve_checks.json").write_text(text)


if __name__ == "__main__":
    main()
