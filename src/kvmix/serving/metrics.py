"""``/metrics`` through ``prometheus_client`` (docs/guide/serving.md): the gauges gateways route on
— ``kvmix:num_requests_waiting``, ``kvmix:num_requests_running``, ``kvmix:kv_cache_usage_perc`` (the
share of the cache budget admitted requests reserve, 0 to 1, as vLLM's) — the cache's pages and
bytes, read from the generation loop's figures at each scrape; and, counted by the server as
requests end, histograms of time to first token, time per output token and request latency, prompt
and output tokens, requests finished by reason and failed by cause."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
GAUGES = {  # figure of the loop's Stats -> (metric, help)
    "waiting": ("kvmix:num_requests_waiting", "requests admitted to the queue, not running"),
    "running": ("kvmix:num_requests_running", "requests decoding now (each choice a row)"),
    "kv_usage": ("kvmix:kv_cache_usage_perc",
                 "share of the cache budget admitted requests reserve, 0 to 1"),
    "pages_used": ("kvmix:pages_used", "cache pages in use, every layer"),
    "pages_free": ("kvmix:pages_free", "cache pages held free, every layer"),
    "cache_bytes": ("kvmix:cache_bytes", "bytes of every storage the cache keeps"),
    "cache_held_bytes": ("kvmix:cache_held_bytes", "of those, bytes holding tokens"),
    "cache_peak_bytes": ("kvmix:cache_peak_bytes", "the most cache_bytes has been"),
    "reserved_bytes": ("kvmix:cache_reserved_bytes", "bytes admitted requests reserve"),
    "budget_bytes": ("kvmix:cache_budget_bytes", "the memory budget"),
    "tokens_per_second": ("kvmix:generation_tokens_per_second",
                          "output tokens per second over the last 10 s"),
    "steps": ("kvmix:steps", "forwards of the generation loop so far"),
    "faulted_steps": ("kvmix:faulted_steps", "steps contained after a fault so far"),
}


class _Loop(Collector):
    """The generation loop's figures, read at each scrape."""

    def __init__(self, figures: Callable[[], dict[str, float]], model: str):
        self.figures, self.model = figures, model

    def collect(self) -> Iterator[GaugeMetricFamily]:
        values = self.figures()
        for key, (name, text) in GAUGES.items():
            if key in values:
                family = GaugeMetricFamily(name, text, labels=["model_name"])
                family.add_metric([self.model], float(values[key]))
                yield family


class Metrics:
    """One server's registry: the loop's gauges and what requests measure as they end."""

    def __init__(self, figures: Callable[[], dict[str, float]], model: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Loop(figures, model))
        self.model = model
        labels = ["model_name"]
        self.ttft = Histogram("kvmix:time_to_first_token_seconds",
                              "seconds from a request's arrival to its first token", labels,
                              registry=self.registry, buckets=SECONDS)
        self.tpot = Histogram("kvmix:time_per_output_token_seconds",
                              "seconds per output token after the first, per request", labels,
                              registry=self.registry, buckets=SECONDS)
        self.latency = Histogram("kvmix:e2e_request_latency_seconds",
                                 "seconds from a request's arrival to its end", labels,
                                 registry=self.registry, buckets=SECONDS)
        self.prompt_tokens = Counter("kvmix:prompt_tokens", "prompt tokens of served requests",
                                     labels, registry=self.registry)
        self.output_tokens = Counter("kvmix:generation_tokens", "output tokens sent",
                                     labels, registry=self.registry)
        self.finished = Counter("kvmix:request_success", "requests answered, by finish reason",
                                [*labels, "finished_reason"], registry=self.registry)
        self.failed = Counter("kvmix:request_failure", "requests failed, by cause",
                              [*labels, "cause"], registry=self.registry)

    def succeeded(self, reasons: list[str], prompt: int, output: int, seconds: float,
                  first: float | None) -> None:
        """A request answered: its choices' finish reasons, tokens in and out, its latency and
        when its first token went out (seconds after arrival)."""
        for reason in reasons:
            self.finished.labels(self.model, reason).inc()
        self.prompt_tokens.labels(self.model).inc(prompt)
        self.output_tokens.labels(self.model).inc(output)
        self.latency.labels(self.model).observe(seconds)
        if first is not None:
            self.ttft.labels(self.model).observe(first)
            if output > 1:
                self.tpot.labels(self.model).observe((seconds - first) / (output - 1))

    def failure(self, cause: str) -> None:
        """A request failed: ``bad_request``, ``fault``, ``timeout``, ``disconnected``,
        ``draining``, ``loop_died``, ``overloaded``, ``unauthorized``, ``too_large``."""
        self.failed.labels(self.model, cause).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
