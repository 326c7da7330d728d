"""The cache inside transformers: exactness of ``full``, padding, beams, loud misuse."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
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
    assert cache.layers[0].store.lengths, "the test must exercise stored blocks"
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


def test_left_padding_never_enters_statistics():
    model = tiny_llama(seed=3)
    ids = torch.randint(1, 97, (2, 40), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    pad = 3
    ids[0, :pad], mask[0, :pad] = 0, 0
    layout = "sink=0,residual=16,group=8"
    exact = kvmix.make_cache(model, f"full:{layout}")
    packed = kvmix.make_cache(model, f"kxvy:key_bits=2,value_bits=2,{layout}")
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=exact, use_cache=True)
        model(ids, attention_mask=mask, cache=packed, use_cache=True)
    for layer_exact, layer_packed in zip(exact.layers, packed.layers, strict=True):
        keys = layer_exact.store.blocks.keys[0, 0]  # block 0 of the padded sequence: [H, 8, D]
        stored = layer_packed.store.blocks.keys.minimum[0, 0, :, 0]  # [H, D]
        valid_min, all_min = keys[:, pad:].amin(1), keys.amin(1)
        assert (valid_min != all_min).any(), "padding keys must be able to change the minimum"
        assert torch.all(stored.float() <= valid_min)
        assert torch.all(valid_min - stored.float() < 1e-2)
        # the unpadded sequence's statistics cover all of its tokens
        other = layer_packed.store.blocks.keys.minimum[1, 0, :, 0].float()
        assert torch.all(other <= layer_exact.store.blocks.keys[1, 0].amin(1))


def test_left_padded_batch_generates_like_each_sequence_alone():
    model = tiny_llama(seed=4)
    g = torch.Generator().manual_seed(4)
    short = torch.randint(1, 97, (1, 30), generator=g)
    long = torch.randint(1, 97, (1, 36), generator=g)
    batch = torch.cat([torch.cat([torch.zeros(1, 6, dtype=torch.long), short], 1), long])
    mask = (batch != 0).long()
    mask[1] = 1
    method = f"kxvy:key_bits=4,value_bits=4,{SMALL}"
    with torch.no_grad():
        greedy = {"max_new_tokens": 25, "min_new_tokens": 25, "do_sample": False}
        together = model.generate(batch, attention_mask=mask, cache=kvmix.make_cache(model, method),
                                  **greedy)
        alone = model.generate(long, cache=kvmix.make_cache(model, method), **greedy)
    assert torch.equal(together[1, 36:], alone[0, 36:])


def test_beam_search_and_sampling_run(tiny_model):
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    cache = kvmix.make_cache(tiny_model, f"kivi2:{SMALL}")
    with torch.no_grad():
        out = tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30,
                                  num_beams=3, do_sample=False, cache=cache)
    assert out.shape == (2, 54)
    assert cache.get_seq_length() == 53  # the last token is produced, never fed back
    assert len(cache.layers[0].store.lengths) == (53 - 4 - 16) // 8 + 1
    assert cache.layers[0].store.blocks.keys.codes.shape[:2] == (6, 5)  # batch x beams, blocks


def test_cache_refuses_a_model_that_does_not_commit(tiny_model):
    cache = kvmix.KVMixCache("kivi2", tiny_model.config)
    tiny_model.set_attn_implementation("sdpa")
    try:
        with pytest.raises(RuntimeError, match="attn_implementation='kvmix'"), torch.no_grad():
            tiny_model(torch.randint(1, 97, (1, 5)), cache=cache, use_cache=True)
    finally:
        kvmix.make_cache(tiny_model, "full")  # restore kvmix attention for other tests


def test_non_finite_keys_are_refused():
    cache = kvmix.KVMixCache(f"kivi2:{SMALL}", tiny_llama().config)
    keys = torch.randn(1, 2, 30, 32)
    keys[0, 0, 10, 0] = float("nan")
    cache.update(keys, torch.randn(1, 2, 30, 32), 0)
    from kvmix.runtime.layer import take_pending

    with pytest.raises(ValueError, match="non-finite keys in layer 0"):
        take_pending().commit(torch.randn(1, 4, 30, 32), None)


def test_sliding_layers_keep_their_cache_with_one_warning():
    model = tiny_llama(layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    with pytest.warns(UserWarning, match="full-attention layers only"):
        cache = kvmix.make_cache(model, f"kivi2:{SMALL}")
    assert isinstance(cache.layers[0], kvmix.runtime.cache.KVMixLayer)
    assert not isinstance(cache.layers[1], kvmix.runtime.cache.KVMixLayer)


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
    first, second = (layer.store.blocks for layer in cache.layers)
    assert (first.keys.bits, second.keys.bits) == (1, 8)
    assert (first.values.bits, second.values.bits) == (2, 4)
    assert second.keys.codes.numel() == 8 * first.keys.codes.numel()
    assert torch.isfinite(dequantize(first.keys)).all()
