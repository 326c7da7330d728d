"""``kvmix recommend``: the cache to deploy. Scores kvmix's methods and the engines' own settings
(llama.cpp's types through ``ggml``, vLLM/SGLang float8 through ``fp8``, vLLM's per-token-head
modes through ``pertoken``) on the same text, then
picks, under a bit budget (``--budget``: effective bits per element, sink and residual priced at
16 bits), the lowest token KL, or under a KL ceiling (``--max-kl``) the fewest bits. Each row
carries the engine flags that run it, or, for kvmix's methods, the nearest engine setting and
what it cannot express (``kvmix.engines.nearest``), each marked measured (kvmix simulates it)
or from the source (bits only)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvmix.commands.args import add_job_arguments, add_length_arguments, config_from
from kvmix.engines.formats import CURRENT
from kvmix.engines.kv_plan import bound
from kvmix.engines.nearest import engine_flags, nearest
from kvmix.evaluation.inputs import JobConfig, load_inputs
from kvmix.evaluation.scoring import check_lengths, score_methods, summary
from kvmix.jobs.report import console, finish
from kvmix.methods import parse_method
from kvmix.models.loading import LoadedModel
from kvmix.runtime.cache import model_spec

KVMIX = ["kivi2", "kivi4", "kxvy:key_bits=4,value_bits=2", "pnmix1", "pnmix2"]
ENGINE = ["ggml:k=q8_0,v=q8_0", "ggml:k=q8_0,v=q4_0", "ggml:k=q4_0,v=q8_0",
          "ggml:k=q4_0,v=q4_0", "fp8:format=e4m3,scale=tensor",
          "pertoken:format=int8_per_token_head", "pertoken:format=int4_per_token_head"]
COLUMNS = {"method": "method", "runs_on": "runs on", "effective_bits": "eff. bits",
           "token_kl": "token KL", "delta_ppl": "Δppl", "meets": "meets", "flags": "flags"}


@dataclass
class RecommendConfig(JobConfig):
    methods: list[str] = field(default_factory=lambda: KVMIX + ENGINE)
    budget: float | None = None
    max_kl: float | None = None
    context: int = 1024
    eval_tokens: int = 256
    chunk: int = 1


def add_parser(commands) -> None:
    parser = commands.add_parser("recommend", help="the cheapest cache within a KL ceiling, or "
                                                   "the most accurate within a bit budget")
    add_job_arguments(parser, RecommendConfig())
    add_length_arguments(parser, RecommendConfig)
    limit = parser.add_mutually_exclusive_group(required=True)
    limit.add_argument("--budget", type=float, help="effective bits per element at most")
    limit.add_argument("--max-kl", type=float, help="token KL vs the float cache at most")
    parser.set_defaults(run=lambda args: run_recommend(config_from(RecommendConfig, args)))


def run_recommend(config: RecommendConfig, loaded: LoadedModel | None = None) -> dict:
    _check(config)
    loaded, ids = load_inputs(config, config.context + config.eval_tokens + 1, loaded)
    scored = score_methods(loaded, ids, ["full", *config.methods], config.context, config.chunk,
                           backend=config.backend)
    rows = [_row(m, summary(scored[m], scored["full"]), loaded, config)
            for m in dict.fromkeys(config.methods)]
    meeting = [r for r in rows if r["meets"]]
    key = "token_kl" if config.budget is not None else "effective_bits"
    choice = min(meeting, key=lambda r: (r[key], r["effective_bits"])) if meeting else None
    limit = (f"budget {config.budget} bits" if config.budget is not None
             else f"token KL ≤ {config.max_kl}")
    finish("recommend", config, loaded, rows, f"{limit} · context {config.context} + "
           f"{config.eval_tokens} tokens", COLUMNS, choice=choice, engine_releases=CURRENT)
    if choice is None:
        console.print(f"no candidate meets {limit}")
    else:
        console.print(f"choice: {choice['method']} ({choice['effective_bits']:.3g} bits, token KL "
                      f"{choice['token_kl']:.4g}) on {choice['runs_on']}: {choice['flags']}")
    return {"rows": rows, "choice": choice}


def _check(config: RecommendConfig) -> None:
    check_lengths(config.context, config.eval_tokens, config.chunk)
    if (config.budget is None) == (config.max_kl is None):
        raise ValueError("give exactly one of budget (bits) or max_kl")
    if config.budget is not None and not 0 < config.budget <= 32:
        raise ValueError(f"budget={config.budget} is invalid; expected bits in (0, 32]")
    if config.max_kl is not None and config.max_kl < 0:
        raise ValueError(f"max_kl={config.max_kl} is invalid; expected >= 0")
    for method in config.methods:
        parse_method(method)


def _row(method: str, figures: dict, loaded: LoadedModel, config: RecommendConfig) -> dict:
    meets = (figures["effective_bits"] <= config.budget if config.budget is not None
             else figures["token_kl"] <= config.max_kl)
    flags = engine_flags(method)
    if flags:
        runs_on = ", ".join(flags)
        text = "; ".join(f"{engine}: {' '.join(f)} (measured)" for engine, f in flags.items())
    else:  # kvmix's own cache; the nearest engine settings are approximations
        runs_on = "kvmix"
        head_dim = model_spec(loaded.model.config).head_dim
        settings = nearest(*bound(loaded, method), head_dim)
        text = "nearest: " + "; ".join(
            f"{engine} {s.setting} ({'measured' if s.simulate else 'from the source'})"
            for engine, s in settings.items())
    return {"method": method, "runs_on": runs_on, **figures, "meets": meets, "flags": text}
