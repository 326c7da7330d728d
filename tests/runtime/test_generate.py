"""Every method and preset through ``model.generate``: left-padded batches reproduce each
sequence run alone, beam search and sampling keep each row's own history, hybrid models work."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import tiny_llama
from helpers import FAST, method_string, padded_prompts
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import kvmix
from kvmix.core.memory import reachable_bytes
from kvmix.methods import method_names

METHODS = method_names()
PROMPTS = (20, 37, 51)  # tokens; left-padded to 51 in the batch


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=4)


def prompts() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(1, 97, (n,), generator=g) for n in PROMPTS]


def runner_and_method(model, name: str):
    method = method_string(name, model if name.startswith("wush") else None)
    return kvmix.prepare_model(model, method), method


@pytest.mark.parametrize(("name", "backend"), [  # backend=cpu: the methods it has a fast path for
    (name, backend) for name in METHODS for backend in ("torch", "cpu")
    if backend == "torch" or name in FAST])
def test_a_padded_batch_generates_exactly_what_each_sequence_generates_alone(model, name,
                                                                               backend):
    """Each sequence keeps its own sink, group boundaries and statistics, and attends over its
    own tokens, so padding changes nothing: 64 greedy tokens (several pages sealed per row, at
    different steps), token for token, every row."""
    runner, method = runner_and_method(model, name)
    ids, mask = padded_prompts(prompts())
    greedy = {"max_new_tokens": 64, "min_new_tokens": 64, "do_sample": False}
    cache = kvmix.make_cache(runner, method, backend=backend)
    with torch.no_grad():
        together = runner.generate(ids, attention_mask=mask, cache=cache, **greedy)
        for b, prompt in enumerate(prompts()):
            alone = runner.generate(prompt[None],
                                    cache=kvmix.make_cache(runner, method, backend=backend),
                                    **greedy)
            assert torch.equal(together[b, ids.shape[1]:], alone[0, len(prompt):]), f"row {b}"
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()


@pytest.mark.parametrize("name", METHODS)
def test_beam_search_keeps_each_beams_own_history(model, name):
    """A beam's score from generate equals the score of its tokens re-read through a fresh
    cache: reorder_cache moved every beam's sink, blocks, residual and selection with it."""
    runner, method = runner_and_method(model, name)
    ids = torch.randint(1, 97, (2, 24), generator=torch.Generator().manual_seed(5))
    cache = kvmix.make_cache(runner, method)
    with torch.no_grad():
        out = runner.generate(ids, attention_mask=torch.ones_like(ids), cache=cache,
                              max_new_tokens=30, num_beams=3, do_sample=False, length_penalty=0.0,
                              eos_token_id=None, output_scores=True, return_dict_in_generate=True)
    assert out.sequences.shape == (2, 54)
    assert len(cache.layers[0].rows) == 6  # batch x beams
    assert cache.nbytes() == reachable_bytes(cache)  # every beam owns its storage
    for b in range(2):
        rescored = teacher_forced(runner, method, out.sequences[b], 24).sum()
        assert rescored.item() == pytest.approx(out.sequences_scores[b].item(), abs=1e-3)


@pytest.mark.parametrize("name", METHODS)
def test_sampling_expands_each_sequence_into_independent_rows(model, name):
    """num_return_sequences repeats every row (batch_repeat_interleave); each sample's logits
    equal those of its own tokens re-read through a fresh cache."""
    runner, method = runner_and_method(model, name)
    ids = torch.randint(1, 97, (1, 24), generator=torch.Generator().manual_seed(6))
    torch.manual_seed(0)
    with torch.no_grad():
        out = runner.generate(ids, attention_mask=torch.ones_like(ids),
                              cache=kvmix.make_cache(runner, method), max_new_tokens=20,
                              do_sample=True, num_return_sequences=3, eos_token_id=None,
                              output_logits=True, return_dict_in_generate=True)
    samples = out.sequences[:, 24:]
    assert len({tuple(s.tolist()) for s in samples}) > 1  # really sampled
    logits = torch.stack(out.logits, 1)  # [3, 20, V]
    for b in range(3):
        expected = torch.log_softmax(logits[b].float(), -1)
        reread = teacher_forced(runner, method, out.sequences[b], 24, full=True)
        torch.testing.assert_close(reread, expected, rtol=0, atol=1e-4)


@torch.no_grad()
def teacher_forced(runner, method: str, sequence: torch.Tensor, prompt: int,
                   full: bool = False) -> torch.Tensor:
    """Log-probabilities of ``sequence[prompt:]`` read one token at a time through a fresh
    cache: [N] of the chosen tokens, or [N, V] with ``full``."""
    cache = kvmix.make_cache(runner, method)
    logits = runner(sequence[None, :prompt], cache=cache, use_cache=True).logits[0, -1]
    out = []
    for t in range(prompt, sequence.shape[0]):
        logprobs = torch.log_softmax(logits.float(), -1)
        out.append(logprobs if full else logprobs[sequence[t]])
        logits = runner(sequence[None, t : t + 1], cache=cache, use_cache=True).logits[0, -1]
    return torch.stack(out)


def tiny_gemma3() -> Gemma3ForCausalLM:
    """Sliding and full layers, one KV head, RoPE frequencies per layer type."""
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, max_position_embeddings=512,
        pad_token_id=0)
    return Gemma3ForCausalLM(config).eval()


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3()


@pytest.mark.parametrize("name", METHODS)
def test_hybrid_models_pack_every_layer_and_sliding_ones_hold_their_window(gemma, name):
    """Gemma-3's sliding layers (window 8) are packed too: they release the pages the window
    has passed, so they hold far fewer tokens than the global layers; every byte is counted."""
    runner, method = runner_and_method(gemma, name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no layer is left unpacked
        cache = kvmix.make_cache(runner, method)
    ids, mask = padded_prompts(prompts()[:2])
    with torch.no_grad():
        out = runner.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=40,
                              min_new_tokens=40, do_sample=False)
    assert out.shape == (2, ids.shape[1] + 40)
    assert cache.packed_layers == cache.layers and not cache.other_layers
    assert [layer.sliding_window for layer in cache.layers] == [8, None, 8, None]
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()
    seen = [sum(row.seen for row in layer.rows) for layer in cache.layers]
    assert seen == [sum(PROMPTS[:2]) + 2 * 39] * 4  # the last token is never fed back
    held = [sum(len(row) for row in layer.rows) for layer in cache.layers]
    assert held[1] == held[3] == seen[1]
    m = cache.method  # per row at most the sink, the pages that meet the window, the residual
    assert held[0] == held[2] <= 2 * (m.sink + m.group * (-(-7 // m.group) + 1) + m.residual)
    assert held[0] < seen[0]
    assert cache.fp16_nbytes() == 4 * 32 * sum(held)  # 16-bit K and V of the tokens held


def test_generate_fills_the_cache_it_is_given(model):
    """transformers < 5.24 has no ``cache=`` and would decode over a cache of its own: the
    kvmix cache handed in must hold every position afterwards, in packed blocks."""
    cache = kvmix.make_cache(model, method_string("kivi2"))
    prompt = prompts()[2][None]
    with torch.no_grad():
        model.generate(prompt, cache=cache, max_new_tokens=40, do_sample=False,
                       eos_token_id=None)
    assert cache.get_seq_length() == prompt.shape[1] + 40 - 1
    assert cache.layers[0].rows[0].lengths and cache.nbytes() > 0
