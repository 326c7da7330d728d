import pytest
import torch
from conftest import tiny_llama
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import CohereConfig, CohereForCausalLM

from kvmix.core.importance import pair_norms
from kvmix.models.rope import _rotary_module, layout_name, rope_pairs


def tiny_cohere():
    torch.manual_seed(0)
    config = CohereConfig(vocab_size=64, hidden_size=64, intermediate_size=64, eos_token_id=2,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    return CohereForCausalLM(config).eval()


MODELS = {"llama": (tiny_llama, "rotate_half"), "cohere": (tiny_cohere, "interleaved")}


@pytest.mark.parametrize("name", MODELS)
def test_layout_is_read_from_the_model(name):
    build, expected = MODELS[name]
    pairs = rope_pairs(build())
    assert layout_name(pairs) == expected
    assert sorted(pairs.flatten().tolist()) == list(range(pairs.numel()))


@pytest.mark.parametrize("name", MODELS)
@settings(max_examples=15, deadline=None)
@given(position=st.integers(0, 4000), seed=st.integers(0, 1000))
def test_pair_norms_are_invariant_under_the_models_own_rope(name, position, seed):
    model = MODELS[name][0]()
    pairs = rope_pairs(model)
    rotary = _rotary_module(model)
    apply = __import__(type(rotary).__module__, fromlist=["x"]).apply_rotary_pos_emb
    dim = pairs.numel()
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(1, 4, 3, dim, generator=g), torch.randn(1, 2, 3, dim, generator=g)
    positions = torch.tensor([[position, position + 1, position + 17]])
    cos, sin = rotary(q[:, 0], positions)
    q_rot, k_rot = apply(q, k, cos, sin)
    assert not torch.allclose(q_rot, q)  # the rotation really moved the vectors
    torch.testing.assert_close(pair_norms(q_rot, pairs), pair_norms(q, pairs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pair_norms(k_rot, pairs), pair_norms(k, pairs), rtol=1e-5, atol=1e-5)
    wrong = torch.arange(dim).view(-1, 2) if name == "llama" else pairs.view(2, -1).T
    assert not torch.allclose(pair_norms(q_rot, wrong), pair_norms(q, wrong), atol=1e-3)


def test_a_model_without_rope_has_no_pairs():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    assert rope_pairs(model) is None
