"""Arguments every command shares, spellings kept for one release, and the command line ->
configuration dataclass step."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any

from kvmix.methods import split_methods
from kvmix.runtime.kernels import BACKENDS

LIST_KINDS = {"list[int]": int, "list[float]": float, "list[str]": str}
BACKEND_HELP = (f"attention over the packed cache: {', '.join(BACKENDS)} (auto: the device's "
                "fused op, the CPU op or Triton on CUDA; torch: the reference path)")


def add_job_arguments(parser: argparse.ArgumentParser, defaults: Any, methods: bool = True,
                      backend: bool = True, data: bool = True) -> None:
    """--model, --data, --methods, --dtype, --device, --backend and --out, with ``defaults``'
    values."""
    parser.add_argument("--model", default=defaults.model,
                        help="'smollm2' (offline default), a transformers id/folder or a .gguf")
    if data:
        parser.add_argument("--data", default=defaults.data, help="'prose', 'code' or a text file")
    if methods:
        parser.add_argument("--methods", default=",".join(defaults.methods),
                            help="comma-separated methods with overrides, e.g. "
                                 "full,kivi2,kxvy:key_bits=4,value_bits=2")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="auto (float32 on CPU), float32, float16, bfloat16")
    parser.add_argument("--device", default=defaults.device,
                        help="the torch device the model runs on: cpu, cuda, cuda:1, ...")
    if backend:
        parser.add_argument("--backend", default=defaults.backend, help=BACKEND_HELP)
    parser.add_argument("--out", default=None, help="folder for results.json (and plots)")


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
                        help="tokens of text prefilled into the cache before the scored ones")
    parser.add_argument("--eval-tokens", type=int, default=cls.eval_tokens,
                        help="tokens scored after --context, teacher-forced (the text's own "
                             "tokens are fed, none is generated)")
    parser.add_argument("--chunk", type=int, default=cls.chunk,
                        help="tokens per teacher-forced decode step (1 = exact decode)")


def add_renamed(parser: argparse.ArgumentParser, flag: str, *old: str, **kwargs: Any
                ) -> argparse.Action:
    """``parser.add_argument(flag, **kwargs)``, and each ``old`` spelling of it accepted into
    the same destination until the next release: hidden from --help, warned about on use."""
    action = parser.add_argument(flag, **kwargs)
    for name in old:
        parser.add_argument(name, action=_Renamed, flag=flag, dest=action.dest,
                            type=action.type, nargs=action.nargs, choices=action.choices,
                            default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return action


def warn_renamed(old: str, new: str) -> None:
    """The one warning every deprecated spelling gives (on stderr)."""
    print(f"kvmix: warning: {old} is deprecated, use {new} (accepted until the next release)",
          file=sys.stderr)


class _Renamed(argparse.Action):
    """An old spelling of ``flag``: stores into its destination after a warning."""

    def __init__(self, option_strings: list[str], dest: str, flag: str, **kwargs: Any):
        super().__init__(option_strings, dest, **kwargs)
        self.flag = flag

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        warn_renamed(option_string, self.flag)
        setattr(namespace, self.dest, values)


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
