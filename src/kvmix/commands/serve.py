"""``kvmix serve``: an OpenAI-compatible server (transformers' serving app) whose continuous
batching keeps every request's KV cache in kvmix's packed pool, admitted by bytes
(``--memory``); ``--method transformers`` serves with transformers' own paged float cache of the
same bytes instead (the anchor of ``kvmix loadtest``). ``--engine vllm`` serves through vLLM's
OpenAI server and kvmix's plugin instead, as ``kvmix loadtest``'s ``vllm:`` rows start it
(``kvmix.serving.vllm_engine``)."""

from __future__ import annotations

import ipaddress
import logging
from pathlib import Path
from typing import Any

import yaml

from kvmix.jobs.ray import require_ray
from kvmix.jobs.report import console
from kvmix.serving.launch import ANCHOR, Scale, ServeConfig, build, deploy_config
from kvmix.serving.vllm_engine import VllmEngine, describe, prepare


def add_parser(commands) -> None:
    parser = commands.add_parser("serve", help="OpenAI-compatible server on the packed cache")
    defaults = ServeConfig()
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    parser.add_argument("--method", default=defaults.method,
                        help=f"a kvmix method string, or '{ANCHOR}' (its own paged float cache)")
    parser.add_argument("--memory", default=defaults.memory, help="KV cache budget, e.g. 2GB")
    parser.add_argument("--host", default=defaults.host,
                        help="address to listen on (beyond loopback: give an API key)")
    parser.add_argument("--port", type=int, default=defaults.port, help="port to listen on")
    parser.add_argument("--backend", default=defaults.backend, help="auto, torch or cpu")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto (float32 on CPU), float32, float16, bfloat16")
    parser.add_argument("--device", default=defaults.device,
                        help="the torch device the model runs on: cpu, cuda, cuda:1, ...")
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens,
                        help="max_tokens of a request that sends none")
    parser.add_argument("--max-batch-tokens", type=int, default=defaults.max_batch_tokens,
                        help="tokens of one forward (prompts joining + one per running request)")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="answer 429 beyond this many waiting requests (0: no limit)")
    parser.add_argument("--fit-prompt", type=int, default=defaults.fit_prompt,
                        help="prompt tokens of the request the startup line sizes")
    parser.add_argument("--max-body", default=defaults.max_body,
                        help="largest request body, e.g. 4MB (413 beyond)")
    parser.add_argument("--request-timeout", type=float, default=defaults.request_timeout,
                        help="seconds a request may take, waiting included (504 beyond; its "
                             "pages return; 0: no deadline)")
    parser.add_argument("--api-key", default=None,
                        help="/v1/* require 'Authorization: Bearer KEY' (default: "
                             "$KVMIX_API_KEY; /health and /metrics stay open)")
    parser.add_argument("--api-key-file", default=None,
                        help="a file holding the key (with --ray: a secret on every node; "
                             "the key is never written into a --ray-config file)")
    parser.add_argument("--drain-timeout", type=float, default=defaults.drain_timeout,
                        help="on SIGTERM/SIGINT: 503 to new requests, running ones finish "
                             "for up to this many seconds, then exit 0")
    _ray_options(parser.add_argument_group("Ray Serve (the ray extra)"))
    _vllm_options(parser.add_argument_group("vLLM (the vllm or vllm-cuda extra)"))
    parser.set_defaults(run=lambda args: run_serve(
        ServeConfig(**{k: getattr(args, k) for k in vars(defaults)}), args))


def _ray_options(ray) -> None:
    ray.add_argument("--ray", action="store_true",
                     help="replicas of this server on Ray Serve, routed by free pages")
    ray.add_argument("--address", default=None,
                     help="the Ray cluster: 'auto' (one started with `ray start`), "
                          "ray://host:10001, or none (a local Ray for this process)")
    ray.add_argument("--replicas", type=int, default=None,
                     help="a fixed number of replicas (default 1; or --min/--max-replicas)")
    ray.add_argument("--min-replicas", type=int, default=None,
                     help="autoscaled on KV utilisation between --min- and --max-replicas")
    ray.add_argument("--max-replicas", type=int, default=None,
                     help="the most replicas autoscaling starts (default: --min-replicas)")
    ray.add_argument("--replica-cpus", type=float, default=1.0,
                     help="CPUs each replica takes (on CUDA a replica takes one GPU)")
    ray.add_argument("--ray-config", default=None, metavar="FILE",
                     help="write the YAML `serve deploy FILE` takes, then exit")


def _vllm_options(vllm) -> None:
    engine = VllmEngine()
    vllm.add_argument("--engine", choices=("kvmix", "vllm"), default="kvmix",
                      help="vllm: vLLM's OpenAI server with kvmix's plugin, in the same "
                           "--memory (its staging counted); --method auto or fp8: vLLM's own "
                           "cache")
    vllm.add_argument("--vllm-python", default=engine.python,
                      help="the vLLM environment's interpreter (`make vllm`)")
    vllm.add_argument("--max-num-seqs", type=int, default=engine.max_num_seqs,
                      help="vLLM's: the most requests running at once (the plugin's staging "
                           "for this many is taken from --memory)")
    vllm.add_argument("--max-model-len", type=int, default=engine.max_model_len,
                      help="vLLM's: the most tokens of a request (default: the model's)")


def run_serve(config: ServeConfig, args: Any = None) -> None:
    """Serve until SIGTERM/SIGINT (drained: exit 0) or the generation loop dies (exit 1); with
    ``--ray``, replicas on Ray Serve; with ``--ray-config``, only the file for them."""
    ray = _ray_arguments(args)
    engine = _vllm_engine(args, ray)
    if engine is not None:
        return _run_vllm(config, engine)
    if ray is not None:
        return _run_ray(config, *ray)
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


def _vllm_engine(args: Any, ray: tuple | None) -> VllmEngine | None:
    """--engine vllm's settings, or None for kvmix's own engine; refused when they do not go
    together."""
    if args is None:
        return None
    engine = VllmEngine(args.vllm_python, args.max_num_seqs, args.max_model_len)
    if args.engine == "kvmix":
        given = [flag for flag, name in (("--vllm-python", "python"),
                                          ("--max-num-seqs", "max_num_seqs"),
                                          ("--max-model-len", "max_model_len"))
                 if getattr(engine, name) != getattr(VllmEngine(), name)]
        if given:
            raise ValueError(f"{', '.join(given)} need --engine vllm")
        return None
    if ray is not None:
        raise ValueError("--engine vllm cannot honour --ray or --ray-config (replicas of "
                         "kvmix's own engine): remove it")
    return engine


def _run_vllm(config: ServeConfig, engine: VllmEngine) -> None:
    """vLLM's server in this process's place: its signals, output and exit code."""
    server, found = prepare(config, engine)
    console.print(describe(server, found, config), soft_wrap=True, markup=False)
    if "VLLM_API_KEY" not in server.env and not _loopback(config.host):
        console.print(f"[yellow]warning: listening on {config.host} without an API key: "
                      "anyone who reaches it can use it (--api-key or KVMIX_API_KEY)[/]")
    server.serve(config.port)


def _ray_arguments(args: Any) -> tuple | None:
    """(scale, address, config file) of --ray or --ray-config, or None; refused when they
    do not go together."""
    if args is None or not (args.ray or args.ray_config):
        if args is not None and (args.address or args.replicas or args.min_replicas
                                 or args.max_replicas):
            raise ValueError("--address and --replicas/--min-replicas/--max-replicas go with "
                             "--ray or --ray-config")
        return None
    autoscaled = args.min_replicas is not None or args.max_replicas is not None
    if autoscaled and args.replicas is not None:
        raise ValueError("give --replicas or --min-replicas/--max-replicas, not both")
    gpus = 1.0 if args.device.startswith("cuda") else 0.0
    scale = Scale(replicas=None if autoscaled else (args.replicas or 1),
                  min_replicas=args.min_replicas if args.min_replicas is not None else 1,
                  max_replicas=args.max_replicas or max(args.min_replicas or 1, 1),
                  cpus=args.replica_cpus, gpus=gpus)
    return scale, args.address, args.ray_config


def _run_ray(config: ServeConfig, scale: Any, address: str | None, path: str | None) -> None:
    if path is not None:
        Path(path).write_text(yaml.safe_dump(deploy_config(config, scale), sort_keys=False))
        console.print(f"wrote {path}: `serve deploy {path}` on a Ray cluster serves it")
        return
    require_ray(serve=True)
    from kvmix.serving.replicas import serve_on_ray

    serve_on_ray(config, scale, address, console.print)
