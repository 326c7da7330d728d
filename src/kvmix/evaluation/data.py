"""Text that works offline (SPEC §9): ``prose`` (CPython's pydoc topics), ``code`` (CPython's
own standard-library sources) or any text file."""

from __future__ import annotations

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
