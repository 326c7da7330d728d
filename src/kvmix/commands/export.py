"""``kvmix export``: WUSH-KV's serving artifacts.

The model with values folded (``save_pretrained``) and one safetensors file of the
right-multipliers per (layer, KV head, block), float64, each [L, H, D/block, block, block]:
``k_right = T_kᵀ`` (k' = k·k_right), ``q_right = T_k⁻¹`` (q' = q·q_right), ``v_right = T_vᵀ``
(v' = v·v_right, what the folded W_V produces) and ``o_right = T_v⁻ᵀ`` (o = o'·o_right, what the
folded W_O undoes), so ``q_right·k_rightᵀ = I`` and ``v_right·o_right = I``.
"""

from __future__ import annotations

from pathlib import Path

from kvmix.core.transforms import save_multipliers
from kvmix.evaluation.report import console
from kvmix.methods import parse_method
from kvmix.models.loading import DEFAULT_MODEL, LoadedModel, drop_gguf_marker, load_model
from kvmix.runtime.folding import prepare_model


def run_export(transforms: str, transform: str, model_out: str,
               loaded: LoadedModel) -> dict[str, Path]:
    """Save the folded model and the right-multipliers (see the module docstring)."""
    method = parse_method(f"wush:transforms={transforms},transform={transform}")
    folded = prepare_model(loaded.model, method)
    out = Path(model_out)
    out.mkdir(parents=True, exist_ok=True)
    drop_gguf_marker(folded)
    folded.save_pretrained(out / "model")
    loaded.tokenizer.save_pretrained(out / "model")
    transforms = method.transform_set()
    path = save_multipliers(out / "right_multipliers.safetensors", transforms, transform)
    console.print(f"wrote {out / 'model'} and {path}")
    return {"model": out / "model", "multipliers": path}


def add_parser(commands) -> None:
    parser = commands.add_parser("export", help="folded model + WUSH right-multipliers for serving")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--transforms", required=True)
    parser.add_argument("--transform", default="wush")
    parser.add_argument("--out", required=True)
    parser.set_defaults(run=lambda args: run_export(args.transforms, args.transform, args.out,
                                                    load_model(args.model, args.dtype)))
