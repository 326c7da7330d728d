"""kvmix: truly packed low-bit KV caches for transformers decoder LLMs.

    import kvmix
    loaded = kvmix.load_model()
    cache = kvmix.make_cache(loaded.model, "pnmix1")
    loaded.model.generate(..., cache=cache)
    kvmix.generate_batch(loaded.model, prompts, "pnmix1", memory="2GB")  # continuous batching
"""

from kvmix.evaluation.scoring import score, token_kl
from kvmix.methods import Method, method_names, parse_method
from kvmix.models.loading import load_model
from kvmix.runtime.attention import make_cache
from kvmix.runtime.cache import KVMixCache
from kvmix.runtime.folding import prepare_model
from kvmix.serving.paged import generate_batch

__version__ = "0.1.0"
__all__ = [
    "KVMixCache",
    "Method",
    "__version__",
    "generate_batch",
    "load_model",
    "make_cache",
    "method_names",
    "parse_method",
    "prepare_model",
    "score",
    "token_kl",
]
