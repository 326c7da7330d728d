"""KV plans (``kv_plan.json``): what a method stores, layer by layer, for one model — widths,
groups, sink, residual, the transforms' checksum and the model's fingerprint — with the nearest
setting of each serving engine and, where kvmix can measure them, the token KL of the plan and
of those settings on the same text. ``load_plan`` gives the method back, for that model only."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from kvmix.engines.nearest import nearest
from kvmix.methods import Method
from kvmix.models.loading import LoadedModel, fingerprint
from kvmix.runtime.attention import make_cache
from kvmix.runtime.cache import model_spec
from kvmix.runtime.folding import prepare_model

PLAN_FILE = "kv_plan.json"


def bound(loaded: LoadedModel, text: str) -> tuple[Method, list[tuple[float, float]]]:
    """The method bound to the model (as its cache binds it) and its (key, value) bits per
    element, layer by layer."""
    method = make_cache(prepare_model(loaded.model, text), text).method
    layers = model_spec(loaded.model.config).n_layers
    return method, [method.bits(i, loaded.dtype) for i in range(layers)]


def make_plan(loaded: LoadedModel, text: str,
              versions: dict[str, str] | None = None) -> dict[str, Any]:
    """The plan of the method ``text`` for the model, as a JSON-ready dict, with the nearest
    settings of the engines' current releases (or those ``versions`` names)."""
    method, layers = bound(loaded, text)
    spec = model_spec(loaded.model.config)
    engines = nearest(method, layers, spec.head_dim, versions)
    return {
        "method": text,
        "resolved": repr(method),
        "parameters": _parameters(method),
        "layout": {"sink": method.sink, "residual": method.residual, "group": method.group},
        "layers": [{"layer": i, "key_bits": k, "value_bits": v}
                   for i, (k, v) in enumerate(layers)],
        "transforms": _transforms(method),
        "model": {"name": loaded.name, "fingerprint": fingerprint(loaded.model),
                  "layers": spec.n_layers, "kv_heads": spec.n_kv_heads,
                  "head_dim": spec.head_dim, "dtype": str(loaded.dtype)},
        "engine_releases": {name: s.release for name, s in engines.items()},
        "engines": {name: dataclasses.asdict(s) for name, s in engines.items()},
    }


def save_plan(out: str | Path, plan: dict[str, Any]) -> Path:
    path = Path(out) / PLAN_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=2) + "\n")
    return path


def load_plan(path: str | Path, model) -> str:
    """The method string of a plan, refused when the plan was made for another model."""
    plan = json.loads(Path(path).read_text())
    made_for, here = plan["model"]["fingerprint"], fingerprint(model)
    if made_for != here:
        raise ValueError(f"{path} was made for model {plan['model']['name']!r} (fingerprint "
                         f"{made_for}); this model's fingerprint is {here}: make a plan for it "
                         "with kvmix export --plan")
    return plan["method"]


def _parameters(method: Method) -> dict[str, Any]:
    values = {f.name: getattr(method, f.name) for f in dataclasses.fields(method)}
    return {k: v if isinstance(v, (int, float, str, bool, list, type(None))) else repr(v)
            for k, v in values.items()}


def _transforms(method: Method) -> dict[str, str] | None:
    """The transforms file a method reads (WUSH) and its SHA-256, or None."""
    path = getattr(method, "transforms", "")
    if not path:
        return None
    digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return {"file": str(path), "sha256": digest}


def measured_kl(plan: dict[str, Any], kl: dict[str, float]) -> None:
    """Put token KLs (by method string) into the plan and its engine settings."""
    plan["kl"] = kl.get(plan["method"])
    for setting in plan["engines"].values():
        setting["kl"] = kl.get(setting["simulate"]) if setting["simulate"] else None


def simulated(plan: dict[str, Any]) -> list[str]:
    """The method strings to score for a plan: itself, then the engines' simulations."""
    sims = [s["simulate"] for s in plan["engines"].values() if s["simulate"]]
    return list(dict.fromkeys([plan["method"], *sims]))
