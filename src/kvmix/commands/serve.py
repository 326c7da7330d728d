"""``kvmix serve``: an OpenAI-compatible server (transformers' serving app) whose continuous
batching keeps every request's KV cache in kvmix's packed pool, admitted by bytes
(``--memory``); ``--method transformers`` serves with transformers' own paged float cache of the
same bytes instead (the anchor of ``kvmix loadtest``)."""

from __future__ import annotations

import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any

from kvmix.evaluation.planner import parse_memory
from kvmix.evaluation.report import console
from kvmix.methods import parse_method

ANCHOR = "transformers"  # transformers' own continuous batching and paged float cache


@dataclass
class ServeConfig:
    model: str = "smollm2"
    method: str = "pnmix1"
    memory: str = "2GB"  # KV cache budget
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"
    dtype: str = "auto"
    device: str = "cpu"
    max_tokens: int = 128  # a request's max_tokens when it sends none
    max_batch_tokens: int = 2048
    max_waiting: int = 0  # 0: requests beyond the budget wait, however many
    fit_prompt: int = 512  # the request the startup line sizes: prompt + max_tokens tokens
    max_body: str = "4MB"  # a request body beyond it gets 413
    request_timeout: float | None = None  # seconds a request may take, waiting included
    api_key: str | None = None  # /v1/* require it (default: $KVMIX_API_KEY)
    drain_timeout: float = 30.0  # seconds running requests may finish after SIGTERM

    def limits(self) -> Any:
        """The server's ``Limits`` (refused here with the parameter named)."""
        from kvmix.serving.server import Limits

        return Limits(self.max_tokens, self.max_waiting,
                      int(parse_memory(self.max_body, "max_body")),
                      self.request_timeout, self.api_key or os.environ.get("KVMIX_API_KEY"),
                      self.drain_timeout)


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="OpenAI-compatible server on the packed cache")
    defaults = ServeConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    parser.add_argument("--method", default=defaults.method,
                        help=f"a kvmix method string, or '{ANCHOR}' (its own paged float cache)")
    parser.add_argument("--memory", default=defaults.memory, help="KV cache budget, e.g. 2GB")
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--backend", default=defaults.backend, help="auto, torch or cpu")
    parser.add_argument("--dtype", default=defaults.dtype)
    parser.add_argument("--device", default=defaults.device)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                        help="max_tokens of a request that sends none")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                        help="tokens of one forward (prompts joining + one per running request)")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="answer 429 beyond this many waiting requests (0: none refused)")
    parser.add_argument("--fit-prompt", type=int, default=defaults.fit_prompt,
                        help="prompt tokens of the request the startup line sizes")
    parser.add_argument("--max-body", default=defaults.max_body,
                        help="largest request body, e.g. 4MB (413 beyond)")
    parser.add_argument("--request-timeout", type=float, default=None,
                        help="seconds a request may take, waiting included (504 beyond; its "
                             "pages return)")
    parser.add_argument("--api-key", default=None,
                        help="/v1/* require 'Authorization: Bearer KEY' (default: "
                             "$KVMIX_API_KEY; /health and /metrics stay open)")
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout,
                        help="on SIGTERM/SIGINT: 503 to new requests, running ones finish "
                             "for up to this many seconds, then exit 0")
    parser.set_defaults(run=lambda args: run_serve(ServeConfig(**{
        k: getattr(args, k) for k in vars(defaults)})))


def build(config: ServeConfig) -> tuple[Any, Any, str]:
    """Everything before the port opens -> (manager, tokenizer, the startup line); a bad
    method, model, size or budget is refused here."""
    from kvmix.models.loading import load_model
    from kvmix.serving.anchor import TransformersManager
    from kvmix.serving.paged import KVMixManager

    method = None if config.method == ANCHOR else parse_method(config.method)
    memory = parse_memory(config.memory)
    for name in ("port", "max_tokens", "max_batch_tokens", "fit_prompt"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < (0 if name == "port" else 1):
            raise ValueError(f"{name}={value!r} is invalid; expected a positive integer")
    config.limits()  # bad limits are refused before the model loads
    try:
        loaded = load_model(config.model, config.dtype, config.device)
    except (OSError, ValueError) as error:
        raise ValueError(f"model={config.model!r} cannot be loaded ({error}); valid: 'smollm2' "
                         "(the offline default), a transformers model folder, a .gguf file, or "
                         "a hub id when the hub is reachable") from None
    if method is None:
        manager = TransformersManager(loaded.model, memory, config.max_tokens,
                                      config.max_batch_tokens)
    else:
        manager = KVMixManager(loaded.model, method, memory, config.backend, config.max_tokens,
                               config.max_batch_tokens, config.fit_prompt + config.max_tokens)
    return manager, loaded.tokenizer, fit_line(manager, config, memory)


def fit_line(manager: Any, config: ServeConfig, memory: float) -> str:
    """What fits, from the planner's formula for this model and budget."""
    length = config.fit_prompt + config.max_tokens
    if not hasattr(manager, "budget"):
        fits = int(manager.blocks // -(-length // 256))
        return (f"transformers' paged float cache: {manager.blocks} pages of 256 tokens in "
                f"{memory / 1e9:.3g} GB: {fits} requests of {config.fit_prompt} + "
                f"{config.max_tokens} tokens at once")
    budget = manager.budget
    return (f"{config.method}: {budget.rows} requests of {config.fit_prompt} + "
            f"{config.max_tokens} tokens fit {memory / 1e9:.3g} GB at once "
            f"({budget.footprint(length) / 1e6:.2f} MB each by the planner's formula); the "
            f"cache is allocated for them: float slots for {budget.rows} requests and "
            f"{budget.capacity[-1]} pages per layer")


def run_serve(config: ServeConfig) -> None:
    """Serve until SIGTERM/SIGINT (drained: exit 0) or the generation loop dies (exit 1)."""
    from kvmix.serving.server import Server, build_app

    limits = config.limits()
    manager, tokenizer, line = build(config)
    try:
        server = Server(build_app(manager, tokenizer, config.model, limits), config.host,
                        config.port)
    except OSError as error:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {error}") from None
    logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kvmix.serve").setLevel(logging.INFO)
    manager.start()
    console.print(f"kvmix serve · {config.model} · {line}")
    console.print(f"listening on {server.url} (/v1/completions, /v1/chat/completions, "
                  "/v1/models, /health, /metrics)")
    if limits.api_key is None and not _loopback(config.host):
        console.print(f"[yellow]warning: listening on {config.host} without an API key: "
                      "anyone who reaches it can use it (--api-key or KVMIX_API_KEY)[/]")
    try:
        code = server.run()
    finally:
        manager.stop(block=True, timeout=10)
    if code:
        raise SystemExit(code)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
