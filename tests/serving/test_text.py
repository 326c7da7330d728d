"""Each choice's text as tokens arrive (``serving/text.py``) with the default model's
tokenizer: stop strings cut the text wherever tokens split them, never earlier than
``min_tokens``; a token's bytes are its own, whole even where it ends inside a character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvmix.models.loading import load_tokenizer
from kvmix.serving.text import ChoiceText, token_bytes

TEXTS = ["héllo wörld 😀 — ok", "naïve café\n\tdéjà vu", "日本語のテキスト", "plain ascii"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_join_into_the_texts_utf8(tokenizer, text):
    """Byte-level tokens that split a character: each token's bytes, joined, are the text's
    UTF-8 exactly (the decoded pieces lose the split characters)."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    parts = [token_bytes(tokenizer, i) for i in ids]
    assert all(parts) and b"".join(parts) == text.encode()


def test_a_special_tokens_bytes_are_its_text(tokenizer):
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


@settings(max_examples=40, deadline=None)
@given(text=st.sampled_from(TEXTS), cut=st.integers(1, 8), min_tokens=st.integers(0, 6))
def test_a_stop_string_cuts_the_text_after_min_tokens(tokenizer, text, cut, min_tokens):
    """A stop string taken from the text: the choice's text is the text up to its first
    occurrence that ends after the first ``min_tokens`` tokens' text, fed token by token."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    stop = text[len(text) // 3 : len(text) // 3 + cut]
    choice = ChoiceText(tokenizer, (stop,), min_tokens=min_tokens)
    released = "".join(choice.feed([i]).text for i in ids) + choice.finish().text
    # the text of the first min_tokens tokens (less a character they leave unfinished)
    protected = len(tokenizer.decode(ids[:min_tokens]).rstrip("\ufffd"))
    found = text.find(stop, protected)
    assert released == (text if found < 0 else text[:found])
    assert choice.stopped == (found >= 0)
