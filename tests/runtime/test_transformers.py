"""The cache inside transformers: exactness of ``full``, padding, beams, loud misuse."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import tiny_llama
from helpers import attend
from transformers import DynamicCache

import kvmix
from kvmix.core.quantizers import dequantize

SMALL = "sink=4,residual=16,group=8"


@torch.no_grad()
def decode_logits(model, cache, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Prefill ids[:, :prompt], then feed one token at a time; logits of every step."""
    out = [model(ids[:, :prompt], cache=cache, use_cache=True).logits[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t : t + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)  # [B, steps, V]


def test_full_reproduces_dynamic_cache_logits(tiny_model):
    ids = torch.randint(1, 97, (2, 70), generator=torch.Generator().manual_seed(1))
    reference = decode_logits(tiny_model, DynamicCache(config=tiny_model.config), ids, 20)
    cache = kvmix.make_cache(tiny_model, f"full:{SMALL}")
    ours = decode_logits(tiny_model, cache, ids, 20)
    assert cache.layers[0].rows[0].lengths, "the test must exercise stored blocks"
    torch.testing.assert_close(ours, reference, rtol=0, atol=1e-5)


def test_quantized_cache_is_read_while_decoding(tiny_model):
    ids = torch.randint(1, 97, (1, 70), generator=torch.Generator().manual_seed(2))
    reference = decode_logits(tiny_model, DynamicCache(config=tiny_model.config), ids, 20)
    def run(bits):
        method = f"kxvy:key_bits={bits},value_bits={bits},{SMALL}"
        return decode_logits(tiny_model, kvmix.make_cache(tiny_model, method), ids, 20)

    two, eight = run(1), run(8)
    assert not torch.allclose(two, reference, atol=1e-3)  # quantization is really seen
    assert (eight - reference).abs().max() < (two - reference).abs().max() / 10


def test_padding_never_enters_a_sequences_store():
    """Each sequence holds only its own tokens: its sink is its first real tokens and its first
    block starts right after them, whatever padding its batch-mates forced."""
    model = tiny_llama(seed=3)
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    pad = 7
    ids[0, :pad], mask[0, :pad] = 0, 0
    exact = kvmix.make_cache(model, f"full:{SMALL}")
    with torch.no_grad():
        positions = (mask.cumsum(-1) - 1).clamp_min(0)  # as generate gives a padded batch
        model(ids, attention_mask=mask, position_ids=positions, cache=exact, use_cache=True)
        alone = kvmix.make_cache(model, f"full:{SMALL}")
        model(ids[:1, pad:], cache=alone, use_cache=True)
    padded, full_row = exact.layers[0].rows
    assert (len(padded), len(full_row)) == (40 - pad, 40)
    assert (len(padded.lengths), len(full_row.lengths)) == (
        (40 - pad - 4 - 16) // 8 + 1, (40 - 4 - 16) // 8 + 1)
    solo = alone.layers[0].rows[0].history(torch.float32)
    for got, expected in zip(padded.history(torch.float32), solo, strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_padding_after_a_real_token_is_refused(tiny_model):
    ids = torch.randint(1, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0  # right padding
    with pytest.raises(ValueError, match=r"rows \[1\] have padding after a real token"), \
            torch.no_grad():
        tiny_model(ids, attention_mask=mask, cache=kvmix.make_cache(tiny_model, "kivi2"),
                   use_cache=True)


def test_cache_refuses_a_model_that_does_not_commit(tiny_model):
    cache = kvmix.KVMixCache("kivi2", tiny_model.config)
    tiny_model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="attn_implementation='kvmix'"), torch.no_grad():
            tiny_model(torch.randint(1, 97, (1, 5)), cache=cache, use_cache=True)
    finally:
        kvmix.make_cache(tiny_model, "full")  # restore kvmix attention for other tests


def test_non_finite_keys_are_refused_naming_the_layer():
    cache = kvmix.KVMixCache(f"kivi2:{SMALL}", tiny_llama().config)
    keys = torch.randn(1, 2, 3, 32)
    keys[0, 0, 1, 0] = float("nan")
    with pytest.raises(ValueError, match="non-finite keys in layer 1"):
        cache.update(keys, torch.randn(1, 2, 3, 32), 1)  # even the residual holds only finite


def test_keys_beyond_the_float16_range_of_the_statistics_are_refused():
    cache = kvmix.KVMixCache(f"kivi2:{SMALL}", tiny_llama().config)
    keys = torch.randn(1, 2, 30, 32)
    keys[0, 1, 10, 5] = 1e6  # in the first block
    with pytest.raises(ValueError, match=r"keys in layer 0 reach 1e\+06, beyond the float16"):
        cache.update(keys, torch.randn(1, 2, 30, 32), 0)  # before the float16 slots round it
    assert cache.get_seq_length() == 0
    exact = kvmix.KVMixCache(f"full:{SMALL}", tiny_llama().config)
    exact.update(keys, torch.randn(1, 2, 30, 32), 0)
    attend(exact, torch.randn(1, 4, 30, 32))  # full precision stores it as it is
    assert exact.layers[0].rows[0].history(torch.float32)[0].abs().max() == 1e6


def test_layers_kvmix_does_not_serve_keep_their_cache_with_one_warning():
    model = tiny_llama(layer_types=["sliding_attention", "chunked_attention"], sliding_window=8,
                       attention_chunk_size=8)
    with pytest.warns(UserWarning, match=r"full-attention and sliding-window layers; layers of "
                                         r"kind \['chunked_attention'\]"):
        cache = kvmix.make_cache(model, f"kivi2:{SMALL}")
    assert isinstance(cache.layers[0], kvmix.runtime.cache.KVMixLayer)
    assert cache.layers[0].sliding_window == 8 and cache.is_sliding == [True, True]
    assert not isinstance(cache.layers[1], kvmix.runtime.cache.KVMixLayer)


def test_a_window_the_attention_disagrees_with_is_refused():
    """Mistral passes its sliding_window to every attention call; a config whose layer_types
    call the layers full would get a cache without the window: refused, not ignored."""
    config = transformers.MistralConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, head_dim=32, sliding_window=8,
                                        layer_types=["full_attention"] * 2)
    model = transformers.MistralForCausalLM(config).eval()
    cache = kvmix.make_cache(model, f"kivi2:{SMALL}")
    with torch.no_grad(), pytest.raises(ValueError, match=r"sliding window of 8 tokens but its "
                                                          r"cache layer is built for "
                                                          r"sliding_window=None"):
        model(torch.randint(1, 97, (1, 12)), cache=cache, use_cache=True)


@pytest.mark.parametrize("bad, message", [
    ("kivi:key_bits=3", r"key_bits=3 is not supported; valid values: \[2, 4\]"),
    ("kxvy:value_bits=5", r"value_bits=5 is not supported"),
    ("kxvy:group=48", r"group=48 must divide residual=128"),
    ("kxvy:value_group=24", r"value_group=24 must divide the head dim 32"),
    ("kxvy:key_bits=4/2/2", r"key_bits lists 3 widths; the model has 2 layers"),
    ("kivi9", r"unknown method 'kivi9'; valid methods: .*kivi2"),
    ("kxvy:bits=2", r"unknown parameter 'bits' .* valid: sink, residual, group"),
    ("kxvy:sink=-1", r"sink=-1 is invalid"),
])
def test_bad_methods_fail_before_any_work(tiny_model, bad, message):
    with pytest.raises(ValueError, match=message):
        kvmix.make_cache(tiny_model, bad)


def test_per_layer_bits_are_used_per_layer(tiny_model):
    cache = kvmix.make_cache(tiny_model, f"kxvy:key_bits=1/8,value_bits=2/4,{SMALL}")
    with torch.no_grad():
        tiny_model(torch.randint(1, 97, (1, 40)), cache=cache, use_cache=True)
    first, second = (layer.rows[0].blocks for layer in cache.layers)
    assert (first.keys.bits, second.keys.bits) == (1, 8)
    assert (first.values.bits, second.values.bits) == (2, 4)
    assert second.keys.codes.numel() == 8 * first.keys.codes.numel()
    assert torch.isfinite(dequantize(first.keys)).all()


def test_a_padded_prefill_hands_kvmix_layers_one_mask_row(monkeypatch):
    """No [B, 1, T, T] mask for a kvmix layer: it reads each row's padding from one row; a
    layer kvmix does not serve (chunked) still gets the full mask, and the logits are
    DynamicCache's."""
    model = tiny_llama(layer_types=["full_attention", "chunked_attention"],
                       attention_chunk_size=64)
    ids = torch.randint(1, 97, (2, 30), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[0, :5], mask[0, :5] = 0, 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    seen = []
    real = kvmix.runtime.layer.KVMixLayer.attend
    monkeypatch.setattr(kvmix.runtime.layer.KVMixLayer, "attend",
                        lambda self, q, m, s: seen.append(m.shape) or real(self, q, m, s))
    with torch.no_grad(), pytest.warns(UserWarning, match="chunked_attention"):
        ours = model(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                     cache=kvmix.make_cache(model, f"full:{SMALL}")).logits
    reference = model(ids, attention_mask=mask, position_ids=positions, use_cache=True,
                      cache=DynamicCache(config=model.config)).logits
    assert seen == [torch.Size([2, 1, 1, 30])]
    torch.testing.assert_close(ours[1], reference[1], rtol=0, atol=1e-5)
    torch.testing.assert_close(ours[0, 5:], reference[0, 5:], rtol=0, atol=1e-5)
