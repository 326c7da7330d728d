"""Arguments every command shares, and the command line -> configuration dataclass step."""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from kvmix.methods import split_methods

LIST_KINDS = {"list[int]": int, "list[float]": float, "list[str]": str}


def add_job_arguments(parser: argparse.ArgumentParser, defaults: Any, methods: bool = True,
                      backend: bool = True) -> None:
    """--model, --data, --methods, --dtype, --device, --backend and --out, with ``defaults``'
    values."""
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    parser.add_argument("--data", default=defaults.data, help="'prose', 'code' or a text file")
    if methods:
        parser.add_argument("--methods", default=",".join(defaults.methods),
                            help="comma-separated methods with overrides, e.g. "
                                 "full,kivi2,kxvy:key_bits=4,value_bits=2")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto (float32 on CPU), float32, float16, bfloat16")
    parser.add_argument("--device", default=defaults.device)
    if backend:
        parser.add_argument("--backend", default=defaults.backend,
                            help="attention over the packed cache: auto (the fused CPU op where "
                                 "it runs), torch (the reference path) or cpu")
    parser.add_argument("--out", default=None, help="folder for results.json")


def add_grid_arguments(parser: argparse.ArgumentParser) -> None:
    """--ray, --address and --workers of the commands whose cells can run on Ray."""
    parser.add_argument("--ray", action="store_true",
                        help="cells as Ray tasks (the ray extra); with --out, a rerun resumes")
    parser.add_argument("--address", default=None,
                        help="the Ray cluster: 'auto' (`ray start`'s), host:port, "
                             "ray://host:10001, or none (a local Ray)")
    parser.add_argument("--workers", type=int, default=2,
                        help="Ray actors, each holding the model once (one GPU each on CUDA)")


def add_length_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """--context, --eval-tokens and --chunk of the commands that score through the cache."""
    parser.add_argument("--context", type=int, default=cls.context,
                        help="prompt tokens prefilled before scoring")
    parser.add_argument("--eval-tokens", type=int, default=cls.eval_tokens,
                        help="tokens scored by decoding over the cache")
    parser.add_argument("--chunk", type=int, default=cls.chunk,
                        help="tokens per teacher-forced decode step (1 = exact decode)")


def config_from(cls: type, args: argparse.Namespace) -> Any:
    """The ``cls`` dataclass from parsed arguments; comma-separated text fills list fields."""
    values = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if isinstance(value, str) and f.name == "methods":
            value = split_methods(value)
        elif isinstance(value, str) and str(f.type) in LIST_KINDS:
            value = _split(value, f.name, LIST_KINDS[str(f.type)])
        values[f.name] = value
    return cls(**values)


def _split(text: str, name: str, kind: type) -> list:
    try:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ValueError(f"{name}={text!r} is invalid; expected comma-separated "
                         f"{kind.__name__} values") from None
