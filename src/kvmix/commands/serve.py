"""``kvmix serve``: an OpenAI-compatible server (transformers' serving app) whose continuous
batching keeps every request's KV cache in kvmix's packed pool, admitted by bytes
(``--memory``); ``--method transformers`` serves with transformers' own paged float cache of the
same bytes instead (the anchor of ``kvmix loadtest``)."""

from __future__ import annotations

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
    if config.max_waiting < 0:
        raise ValueError(f"max_waiting={config.max_waiting} is invalid; expected >= 0")
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
    from kvmix.serving.server import Server, build_app

    manager, tokenizer, line = build(config)
    try:
        server = Server(build_app(manager, tokenizer, config.model, config.max_tokens,
                                  config.max_waiting), config.host, config.port)
    except OSError as error:
        raise ValueError(f"cannot listen on {config.host}:{config.port}: {error}") from None
    manager.start()
    console.print(f"kvmix serve · {config.model} · {line}")
    console.print(f"listening on {server.url} (/v1/completions, /v1/chat/completions, "
                  "/v1/models, /health, /metrics)")
    try:
        server.run()
    finally:
        manager.stop(block=True, timeout=10)
