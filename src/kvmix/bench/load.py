"""A load generator for an OpenAI-compatible server: streamed ``/v1/completions`` requests with
at most ``concurrency`` in flight, each timed by its own chunks (time to first token, time per
output token after it), while ``/metrics`` is sampled for the most requests running at once and
the most cache bytes held. Every figure is measured by this client, on the wall clock."""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
from dataclasses import dataclass
from time import perf_counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

SAMPLE_EVERY = 0.25  # seconds between /metrics samples


@dataclass
class Outcome:
    """One request as the client saw it."""

    start: float
    end: float
    first: float | None = None  # when the first text chunk arrived
    tokens: int = 0  # completion tokens, as the final usage chunk counts them
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.start

    @property
    def per_token(self) -> float | None:
        """Seconds per output token after the first."""
        if self.first is None or self.tokens < 2:
            return None
        return (self.end - self.first) / (self.tokens - 1)


async def complete(http: httpx.AsyncClient, prompt: str, tokens: int,
                   temperature: float = 0.0) -> Outcome:
    """One streamed completion of exactly ``tokens`` tokens (``ignore_eos``), sampled at
    ``temperature`` (0: greedy)."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
            "temperature": temperature, "stream_options": {"include_usage": True}}
    outcome = Outcome(perf_counter(), 0.0)
    try:
        async with http.stream("POST", "/v1/completions", json=body) as answer:
            if answer.status_code != 200:
                outcome.error = f"HTTP {answer.status_code}: {(await answer.aread())[:300]!r}"
            else:
                await _read_stream(answer, outcome)
    except httpx.HTTPError as error:
        outcome.error = f"{type(error).__name__}: {error}"
    outcome.end = perf_counter()
    if outcome.error is None and outcome.tokens != tokens:
        outcome.error = f"{outcome.tokens} of {tokens} tokens"
    return outcome


async def _read_stream(answer: httpx.Response, outcome: Outcome) -> None:
    async for line in answer.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            outcome.error = str(chunk["error"])
            return
        if chunk["choices"] and chunk["choices"][0].get("text") and outcome.first is None:
            outcome.first = perf_counter()
        usage = chunk.get("usage")
        if usage:
            outcome.tokens, outcome.prompt_tokens = (usage["completion_tokens"],
                                                     usage["prompt_tokens"])


async def sample_metrics(http: httpx.AsyncClient, peaks: dict[str, float],
                         done: asyncio.Event) -> None:
    """The largest value of each ``/metrics`` gauge while the level runs."""
    while not done.is_set():
        try:
            for name, value in parse_metrics((await http.get("/metrics")).text).items():
                peaks[name] = max(peaks.get(name, value), value)
        except httpx.HTTPError:
            pass
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(done.wait(), SAMPLE_EVERY)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text (``prometheus_client``'s parser) -> {gauge name: value}, summed over
    label values."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.type == "gauge":
            values[family.name] = sum(sample.value for sample in family.samples)
    return values


async def run_level(url: str, prompts: list[str], tokens: list[int], concurrency: int,
                    timeout: float, temperature: float = 0.0
                    ) -> tuple[list[Outcome], float, dict[str, float]]:
    """All ``prompts`` with at most ``concurrency`` in flight, the i-th asking for
    ``tokens[i % len(tokens)]`` tokens -> (outcomes, wall seconds, the peak of every /metrics
    gauge)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as http:
        async def bounded(prompt: str, count: int) -> Outcome:
            async with gate:
                return await complete(http, prompt, count, temperature)

        peaks: dict[str, float] = {}
        done = asyncio.Event()
        sampler = asyncio.create_task(sample_metrics(http, peaks, done))
        start = perf_counter()
        outcomes = await asyncio.gather(*(bounded(p, tokens[i % len(tokens)])
                                          for i, p in enumerate(prompts)))
        wall = perf_counter() - start
        done.set()
        await sampler
    return list(outcomes), wall, peaks


def summary(outcomes: list[Outcome], wall: float) -> dict[str, float | int]:
    """requests/s and output tokens/s over the wall clock; p50/p99 of time to first token and
    of time per output token; failures."""
    good = [o for o in outcomes if o.error is None]
    ttft = [o.ttft for o in good if o.ttft is not None]
    per_token = [o.per_token for o in good if o.per_token is not None]
    return {"requests": len(outcomes), "failures": len(outcomes) - len(good),
            "wall_s": wall, "requests_per_s": len(good) / wall,
            "output_tokens_per_s": sum(o.tokens for o in good) / wall,
            "prompt_tokens": statistics.mean(o.prompt_tokens for o in good) if good else 0,
            "ttft_p50_s": quantile(ttft, 0.5), "ttft_p99_s": quantile(ttft, 0.99),
            "tpot_p50_ms": 1e3 * quantile(per_token, 0.5),
            "tpot_p99_ms": 1e3 * quantile(per_token, 0.99)}


def quantile(values: list[float], q: float) -> float:
    """The q-quantile (linear interpolation), NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    at = q * (len(ordered) - 1)
    low = int(at)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (at - low)
