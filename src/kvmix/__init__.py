"""kvmix: truly packed low-bit KV caches for transformers decoder LLMs."""

from kvmix.runtime.attention import make_cache
from kvmix.runtime.cache import KVMixCache
from kvmix.methods import Method, parse_method

__version__ = "0.1.0"
__all__ = ["KVMixCache", "Method", "__version__", "make_cache", "parse_method"]
