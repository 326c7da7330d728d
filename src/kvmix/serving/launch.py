"""What one ``kvmix serve`` builds, from its configuration (the command line's, a Ray Serve
replica's): the model, the continuous-batching manager with its cache sized from the budget,
and the limits of its app; a bad method, model, size or limit is refused before the model
loads."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvmix.capacity import parse_memory
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
    max_waiting: int = 256  # 429 beyond this many waiting requests (0: no limit)
    fit_prompt: int = 512  # the request the startup line sizes: prompt + max_tokens tokens
    max_body: str = "4MB"  # a request body beyond it gets 413
    request_timeout: float = 600.0  # seconds a request may take, waiting included (0: none)
    api_key: str | None = None  # /v1/* require it (default: $KVMIX_API_KEY)
    api_key_file: str | None = None  # or a file holding it (a secret mounted on every node)
    drain_timeout: float = 30.0  # seconds running requests may finish after SIGTERM

    def key(self) -> str | None:
        """The API key: ``api_key``, else ``api_key_file``'s content, else $KVMIX_API_KEY."""
        if self.api_key:
            return self.api_key
        if self.api_key_file:
            try:
                return Path(self.api_key_file).read_text().strip() or None
            except OSError as error:
                raise ValueError(f"api_key_file={self.api_key_file!r} cannot be read "
                                 f"({error.strerror})") from None
        return os.environ.get("KVMIX_API_KEY") or None

    def limits(self) -> Any:
        """The server's ``Limits`` (refused here with the parameter named)."""
        from kvmix.serving.server import Limits  # fastapi: the serve extra

        return Limits(self.max_tokens, self.max_waiting,
                      int(parse_memory(self.max_body, "max_body")),
                      self.request_timeout or None, self.key(), self.drain_timeout)


def check(config: ServeConfig) -> None:
    """Refuse a bad method, size or limit, before any model loads."""
    if config.method != ANCHOR:
        parse_method(config.method)
    parse_memory(config.memory)
    for name in ("port", "max_tokens", "max_batch_tokens", "fit_prompt"):
        value = getattr(config, name)
        if not isinstance(value, int) or value < (0 if name == "port" else 1):
            raise ValueError(f"{name}={value!r} is invalid; expected a positive integer")
    config.limits()


def planned_rows(config: ServeConfig) -> int:
    """How many requests of ``fit_prompt + max_tokens`` tokens one server's budget runs at
    once, by the planner's formula, from the model's configuration alone (no weights)."""
    from kvmix.capacity import bound
    from kvmix.models.catalog import from_config
    from kvmix.models.loading import load_config, resolve_dtype
    from kvmix.serving.anchor import PAGE
    from kvmix.serving.budget import Budget

    try:
        model_config, checkpoint = load_config(config.model)
    except (OSError, ValueError) as error:
        raise unloadable(config, error) from None
    arch = from_config(model_config.get_text_config(decoder=True).to_dict(), config.model)
    dtype = resolve_dtype(config.dtype, config.device, checkpoint)
    memory = parse_memory(config.memory)
    length = min(config.fit_prompt + config.max_tokens, arch.max_positions or 1 << 30)
    if config.method == ANCHOR:
        page = 2 * arch.layers * arch.kv_heads * arch.head_dim * dtype.itemsize * PAGE
        return max(int(memory // page) // -(-length // PAGE), 1)
    budget = Budget(bound(config.method, arch), arch, dtype, memory, config.max_batch_tokens,
                    length)
    return budget.rows


def build(config: ServeConfig) -> tuple[Any, Any, str]:
    """Everything before the port opens -> (manager, tokenizer, the startup line); a bad
    method, model, size or budget is refused here."""
    from kvmix.models.loading import load_model
    from kvmix.serving.anchor import TransformersManager
    from kvmix.serving.paged import KVMixManager

    check(config)
    method = None if config.method == ANCHOR else parse_method(config.method)
    memory = parse_memory(config.memory)
    try:
        loaded = load_model(config.model, config.dtype, config.device)
    except (OSError, ValueError) as error:
        raise unloadable(config, error) from None
    if method is None:
        manager = TransformersManager(loaded.model, memory, config.max_tokens,
                                      config.max_batch_tokens)
    else:
        manager = KVMixManager(loaded.model, method, memory, config.backend, config.max_tokens,
                               config.max_batch_tokens, config.fit_prompt + config.max_tokens)
    return manager, loaded.tokenizer, fit_line(manager, config, memory)


def unloadable(config: ServeConfig, error: Exception) -> ValueError:
    return ValueError(f"model={config.model!r} cannot be loaded ({error}); valid: 'smollm2' "
                      "(the offline default), a transformers model folder, a .gguf file, or a "
                      "hub id when the hub is reachable")


def fit_line(manager: Any, config: ServeConfig, memory: float) -> str:
    """What fits, from the planner's formula for this model and budget."""
    from kvmix.serving.anchor import PAGE

    length = config.fit_prompt + config.max_tokens
    if not hasattr(manager, "budget"):
        fits = int(manager.blocks // -(-length // PAGE))
        return (f"transformers' paged float cache: {manager.blocks} pages of {PAGE} tokens in "
                f"{memory / 1e9:.3g} GB: {fits} requests of {config.fit_prompt} + "
                f"{config.max_tokens} tokens at once")
    budget = manager.budget
    return (f"{config.method}: {budget.rows} requests of {config.fit_prompt} + "
            f"{config.max_tokens} tokens fit {memory / 1e9:.3g} GB at once "
            f"({budget.footprint(length) / 1e6:.2f} MB each by the planner's formula); the "
            f"cache is allocated for them: an arena of {budget.arena} float slots per layer "
            f"({budget.rows} requests' sinks and residuals, {budget.slots / 1e6:.2f} MB each, "
            f"in {str(budget.method.slot_dtype(budget.dtype)).removeprefix('torch.')}; a "
            f"shorter request takes fewer, so up to {budget.most_rows} run at once) and "
            f"{budget.capacity[-1]} pages per layer")


@dataclass
class Scale:
    """How many replicas, and what each takes of a node."""

    replicas: int | None = 1  # fixed; None: autoscaled between min and max
    min_replicas: int = 1
    max_replicas: int = 1
    cpus: float = 1.0  # CPUs per replica (a CUDA replica takes a GPU instead)
    gpus: float = 0.0
    target: float = 0.7  # the KV utilisation autoscaling keeps
    per_node: int = 0  # at most this many replicas per node (0: no limit)

    def __post_init__(self):
        if self.replicas is not None and not self.replicas >= 1:
            raise ValueError(f"replicas={self.replicas} is invalid; expected >= 1")
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"min_replicas={self.min_replicas}, max_replicas="
                             f"{self.max_replicas} are invalid; expected 0 <= min <= max, "
                             "max >= 1")
        if not self.cpus > 0 or self.gpus < 0:
            raise ValueError(f"cpus={self.cpus}, gpus={self.gpus} are invalid; expected "
                             "cpus > 0, gpus >= 0")
        if not 0 < self.target <= 1:
            raise ValueError(f"target={self.target} is invalid; expected a share in (0, 1]")


def deploy_config(config: ServeConfig, scale: Scale) -> dict[str, Any]:
    """What ``serve deploy FILE`` takes (YAML): the application by import path with its
    arguments, the proxy on ``config.host:config.port``; never the API key itself."""
    check(config)
    if config.api_key:
        raise ValueError("api_key is not written into a deploy file (it would lie there in "
                         "plain text): give api_key_file, a secret file on every node, or set "
                         "KVMIX_API_KEY where the Serve controller runs (`ray start --head`)")
    return {"proxy_location": "EveryNode",
            "http_options": {"host": config.host, "port": config.port},
            "applications": [{"name": "kvmix", "route_prefix": "/",
                              "import_path": "kvmix.serving.replicas:build_application",
                              "args": {**asdict(config), "scale": asdict(scale)}}]}
