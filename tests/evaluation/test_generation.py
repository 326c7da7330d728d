"""Long-generation pairing: both caches step together, the followed cache's greedy tokens are
what ``generate`` gives, a padded batch equals each prompt alone, and the summaries."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama
from helpers import method_string

import kvmix
from kvmix.evaluation.generation import (
    first_divergence,
    left_pad,
    paired_decode,
    survival,
)

PROMPTS = [[5, 9, 13, 2, 7, 41, 3] * 6, [8, 1, 66, 4] * 4]  # 42 and 16 tokens
STEPS = 60
KIVI = method_string("kivi2")  # the small test layout: blocks flush within STEPS


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=7)


def generated(model, method: str, prompt: list[int]) -> torch.Tensor:
    out = model.generate(torch.tensor([prompt]), cache=kvmix.make_cache(model, method),
                         do_sample=False, max_new_tokens=STEPS, eos_token_id=None)
    return out[0, len(prompt):]


@pytest.mark.parametrize("follow, method", [("reference", "full"), ("method", KIVI)])
def test_the_followed_tokens_are_what_generate_gives_each_prompt(model, follow, method):
    """Left-padded together, each row follows exactly the greedy path ``generate`` takes for
    its prompt alone with the followed cache."""
    paired = paired_decode(model, "full", KIVI, PROMPTS, STEPS, pad=0, follow=follow)
    assert paired.tokens.shape == paired.kl.shape == (2, STEPS)
    for b, prompt in enumerate(PROMPTS):
        assert torch.equal(paired.tokens[b], generated(model, method, prompt)), f"row {b}"


def test_kl_is_zero_against_itself_and_positive_for_a_quantized_cache(model):
    same = paired_decode(model, "full", "full", PROMPTS, 20, pad=0, follow="method")
    assert same.kl.abs().max() < 1e-5
    quantized = paired_decode(model, "full", KIVI, PROMPTS, STEPS, pad=0, follow="reference")
    assert (quantized.kl[:, -10:] > 1e-6).all()  # blocks of the history are quantized
    assert (quantized.kl >= -1e-6).all()


def test_a_batch_scores_each_prompt_as_it_would_alone(model):
    pnmix = method_string("pnmix1")
    together = paired_decode(model, "full", pnmix, PROMPTS, 30, pad=0, follow="method")
    for b, prompt in enumerate(PROMPTS):
        alone = paired_decode(model, "full", pnmix, [prompt], 30, pad=0, follow="method")
        assert torch.equal(together.tokens[b], alone.tokens[0])
        torch.testing.assert_close(together.kl[b], alone.kl[0], rtol=1e-3, atol=1e-6)


def test_divergence_and_survival():
    reference = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]])
    tokens = torch.tensor([[1, 2, 3, 4], [9, 2, 3, 4], [1, 2, 9, 9]])
    assert first_divergence(tokens, reference).tolist() == [4, 0, 2]
    assert survival([4, 0, 2], 4) == pytest.approx([2 / 3, 2 / 3, 1 / 3, 1 / 3, 0])


def test_left_pad_right_aligns_each_prompt():
    ids, mask = left_pad([[4, 5, 6], [7]], pad=0)
    assert ids.tolist() == [[4, 5, 6], [0, 0, 7]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_follow_must_name_a_side(model):
    with pytest.raises(ValueError, match="follow='both' is invalid; valid: reference, method"):
        paired_decode(model, "full", "kivi2", PROMPTS, 4, pad=0, follow="both")
