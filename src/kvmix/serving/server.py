"""``kvmix serve``: transformers' OpenAI-compatible app, assembled from its serving modules
(``transformers.cli.serving``: ``build_server``, the completion and chat handlers, the
continuous-batching generation manager and streamer), with kvmix's continuous batching
underneath and ``/metrics`` (Prometheus text) beside ``/v1/completions``,
``/v1/chat/completions`` (streaming or not), ``/v1/models`` and ``/health``.

What kvmix adds to transformers' handlers: requests are greedy (a sampling, penalty, stop,
logprob or ``n``/``best_of`` > 1 parameter is refused with 400 naming it, never ignored); a
request that can never be served (prompt plus ``max_tokens`` beyond the model's positions, the
budget, or one forward) is refused with 400 naming the limit before it is queued; with
``max_waiting``, a request beyond that many waiting ones gets 429; malformed JSON gets 400;
``ignore_eos`` (as vLLM's) generates exactly ``max_tokens`` tokens.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, TimedModel
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import CBGenerateManager, GenerationState
from transformers.utils import logging

# transformers' routes this server does not offer (no handler behind them here)
UNSERVED = {"/v1/responses", "/v1/systemone", "/v1/audio/transcriptions", "/load_model",
            "/reset"}
EXTENSIONS = {"ignore_eos"}  # kvmix's own request fields


def refused_parameter(body: dict) -> str | None:
    """The first parameter of ``body`` kvmix serve would not apply, as a message, or None."""
    checks = {
        "n": lambda v: v not in (None, 1), "best_of": lambda v: v not in (None, 1),
        "temperature": lambda v: v not in (None, 0, 0.0),
        "top_p": lambda v: v not in (None, 1, 1.0), "logprobs": bool, "top_logprobs": bool,
        "echo": bool, "stop": bool, "logit_bias": bool, "generation_config": bool,
        "presence_penalty": lambda v: v not in (None, 0, 0.0),
        "frequency_penalty": lambda v: v not in (None, 0, 0.0)}
    for name, refused in checks.items():
        if name in body and refused(body[name]):
            return (f"{name}={body[name]!r} is not served: kvmix serve decodes greedily, one "
                    "completion per request (n=1, temperature=0, no penalties, stop strings "
                    "or logprobs)")
    return None


class Greedy:
    """A transformers handler mixin: refuse what would be ignored, fill ``max_tokens``."""

    default_max_tokens = 128

    def _validate_request(self, body: dict) -> None:
        why = refused_parameter(body)
        if why:
            raise HTTPException(status_code=400, detail=why)
        if not isinstance(body.get("ignore_eos", False), bool):
            raise HTTPException(status_code=400, detail="ignore_eos must be true or false")
        super()._validate_request({k: v for k, v in body.items() if k not in EXTENSIONS})
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = self.default_max_tokens

    def _build_generation_config(self, body: dict, model_generation_config: Any,
                                 use_cb: bool = False) -> Any:
        config = super()._build_generation_config(body, model_generation_config, use_cb)
        if body.get("ignore_eos"):
            config.eos_token_id = -1
        return config


class Completions(Greedy, CompletionHandler):
    """``/v1/completions``."""


class Chat(Greedy, ChatCompletionHandler):
    """``/v1/chat/completions``."""


class Models(ModelManager):
    """transformers' model manager holding the one model kvmix loaded, never unloaded."""

    def __init__(self, model: Any, tokenizer: Any, name: str):
        super().__init__(device=str(model.device), model_timeout=-1)
        self.force_model = name
        self.created = int(time.time())
        self.loaded_models[self.process_model_name(name)] = TimedModel(model, -1, tokenizer)

    @staticmethod
    def process_model_name(model_id: str) -> str:
        return model_id  # the name it was loaded by, no hub revision

    def list_models(self, cache_dir: str | None = None) -> list[dict]:
        return [{"id": self.force_model, "object": "model", "created": self.created,
                 "owned_by": "kvmix"}]


class Generation(CBGenerateManager):
    """transformers' continuous-batching generation over a started manager, refusing first a
    request that can never be served (400) or, beyond ``max_waiting`` waiting, 429."""

    def __init__(self, manager: Any, max_waiting: int = 0):
        super().__init__()
        self._cb = manager
        self.max_waiting = max_waiting

    def _admit(self, inputs: dict, config: Any) -> None:
        why = self._cb.refusal(len(inputs["input_ids"]), config.max_new_tokens)
        if why:
            raise HTTPException(status_code=400, detail=why)
        waiting = self._cb.stats.snapshot()["waiting"] + self._cb.input_queue.qsize()
        if self.max_waiting and waiting >= self.max_waiting:
            raise HTTPException(status_code=429, detail=f"{waiting:.0f} requests are waiting "
                                f"(max_waiting={self.max_waiting}): retry later")

    def generate_streaming(self, model, processor, inputs, gen_config, request_id,
                           response_parser=None):
        self._admit(inputs, gen_config)
        return super().generate_streaming(model, processor, inputs, gen_config, request_id,
                                          response_parser)

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        self._admit(inputs, gen_config)
        return await super().generate_non_streaming(model, processor, inputs, gen_config,
                                                    request_id)

    def stop(self) -> None:
        self._cb.stop(block=True, timeout=10)


class State(GenerationState):
    """Every request through the one generation manager."""

    def __init__(self, generation: Generation):
        super().__init__(continuous_batching=True)
        self.generation = generation

    def use_continuous_batching(self, model: Any, modality: Any) -> bool:
        return True

    def get_manager(self, model_id: str, use_cb: bool = False) -> Generation:
        return self.generation

    def shutdown(self) -> None:
        self.generation.stop()

    def is_cb_alive(self) -> bool:
        return self.generation.is_alive()


def build_app(manager: Any, tokenizer: Any, name: str, max_tokens: int = 128,
              max_waiting: int = 0) -> FastAPI:
    """The app over ``manager`` (a started ``KVMixManager`` or ``TransformersManager``)."""
    for handler in ("completion", "chat_completion"):  # a warning line per request
        logging.get_logger(f"transformers.cli.serving.{handler}").setLevel(logging.ERROR)
    models = Models(manager.model, tokenizer, name)
    state = State(Generation(manager, max_waiting))
    handlers = [cls(model_manager=models, generation_state=state) for cls in (Chat,
                                                                             Completions)]
    for handler in handlers:
        handler.default_max_tokens = max_tokens
    app = build_server(models, handlers[0], handlers[1], None, None, None, state)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", "") not in UNSERVED]

    @app.exception_handler(RequestValidationError)
    async def malformed(_request: Request, error: RequestValidationError) -> JSONResponse:
        return JSONResponse({"error": f"malformed request body: {error.errors()[:1]}"}, 400)

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(prometheus(manager.stats.snapshot(), name),
                                 media_type="text/plain; version=0.0.4")

    return app


METRICS = {  # snapshot key -> (metric, type, help)
    "running": ("kvmix_requests_running", "gauge", "requests decoding now"),
    "waiting": ("kvmix_requests_waiting", "gauge", "requests admitted to the queue, not running"),
    "pages_used": ("kvmix_pages_used", "gauge", "cache pages in use, every layer"),
    "pages_free": ("kvmix_pages_free", "gauge", "cache pages held free, every layer"),
    "cache_bytes": ("kvmix_cache_bytes", "gauge", "bytes of every storage the cache keeps"),
    "cache_held_bytes": ("kvmix_cache_held_bytes", "gauge", "of those, bytes holding tokens"),
    "cache_peak_bytes": ("kvmix_cache_peak_bytes", "gauge", "the most cache_bytes has been"),
    "reserved_bytes": ("kvmix_cache_reserved_bytes", "gauge", "bytes admitted requests reserve"),
    "budget_bytes": ("kvmix_cache_budget_bytes", "gauge", "the memory budget"),
    "tokens_per_second": ("kvmix_decode_tokens_per_second", "gauge",
                          "output tokens per second over the last 10 s"),
    "output_tokens": ("kvmix_output_tokens_total", "counter", "output tokens generated"),
    "steps": ("kvmix_steps_total", "counter", "forwards of the generation loop"),
}


def prometheus(values: dict[str, float], model: str) -> str:
    """Prometheus text exposition of a ``Stats`` snapshot."""
    lines = []
    for key, (metric, kind, text) in METRICS.items():
        if key in values:
            lines += [f"# HELP {metric} {text}", f"# TYPE {metric} {kind}",
                      f'{metric}{{model="{model}"}} {values[key]:.6g}']
    name = "kvmix_time_to_first_token_seconds"
    lines += [f"# HELP {name} seconds from a request's arrival to its first token",
              f"# TYPE {name} summary",
              f'{name}_sum{{model="{model}"}} {values["ttft_sum"]:.6g}',
              f'{name}_count{{model="{model}"}} {values["ttft_count"]:.0f}']
    return "\n".join(lines) + "\n"


class Server:
    """The app on ``host:port`` in a thread of this process (``start``/``stop``), or in the
    foreground (``run``); ``port=0`` takes a free port, readable as ``port`` once started."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 8000):
        import uvicorn

        self.socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.socket.bind((host, port))  # the port is taken (or refused) before any serving
        self.host, self.port = host, self.socket.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        self.server.run(sockets=[self.socket])

    def start(self, timeout: float = 30.0) -> None:
        self.thread = threading.Thread(target=lambda: asyncio.run(
            self.server.serve(sockets=[self.socket])), name="kvmix-serve", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.05)

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.socket.close()
