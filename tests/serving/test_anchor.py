"""transformers' own continuous batching as kvmix serves it for comparison
(``TransformersManager``): its float cache sized from the bytes it is given, what it refuses,
and its requests' tokens — greedy ones what ``generate`` gives each prompt alone with a float
cache, seeded ones the same whatever runs beside them."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import run_requests, tiny_llama

from kvmix.serving.anchor import PAGE, TransformersManager
from kvmix.serving.sampling import Sampling

NEW = 12


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=6)


def prompts(lengths=(9, 30, 17)) -> list[list[int]]:
    g = torch.Generator().manual_seed(6)
    return [torch.randint(1, 97, (n,), generator=g).tolist() for n in lengths]


def page_bytes(model) -> int:
    config = model.config  # 2 layers x 2 KV heads x head dim 32, float32, keys and values
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4 * PAGE


def test_the_cache_is_sized_from_its_bytes_and_refuses_what_never_fits(model):
    """A page's bytes (and a little): one page; a request needing more pages, more positions
    or no tokens is refused naming why; a budget below one page is refused."""
    manager = TransformersManager(copy.deepcopy(model), page_bytes(model) + 100, NEW)
    assert manager.blocks == 1
    assert manager.refusal(10, 20) is None
    assert "2 pages" in manager.refusal(PAGE, 10)
    assert "2 pages" in manager.refusal(10, 20, n=2)  # each choice copies its pages
    assert manager.refusal(500, 20) is not None  # beyond the model's 512 positions
    assert manager.refusal(10, 0) is not None
    with pytest.raises(ValueError, match="holds no page"):
        TransformersManager(copy.deepcopy(model), page_bytes(model) - 1)


def test_greedy_requests_give_what_generate_gives_alone(model):
    """Three prompts batched: each one's tokens are generate's with a float cache."""
    manager = TransformersManager(copy.deepcopy(model), 8 * page_bytes(model), NEW)
    out = run_requests(manager, [{"input_ids": p, "request_id": f"r{i}", "eos_token_id": -1}
                        for i, p in enumerate(prompts())])
    for i, prompt in enumerate(prompts()):
        with torch.no_grad():
            alone = model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                   do_sample=False, eos_token_id=None)
        assert out[f"r{i}"].generated_tokens == alone[0, len(prompt):].tolist(), i


def test_a_seeded_request_draws_the_same_alone_and_beside_others(model):
    """A seeded sampled request, alone and beside two others (one greedy, one sampled):
    the same tokens; another seed, other tokens."""
    mine = {"input_ids": prompts()[1], "request_id": "mine", "eos_token_id": -1}

    def served(seed: int, others: list[dict]) -> list[int]:
        manager = TransformersManager(copy.deepcopy(model), 8 * page_bytes(model), NEW)
        asked = {**mine, "sampling": Sampling(temperature=1.0, top_k=20, seed=seed)}
        return run_requests(manager, [*others, asked])["mine"].generated_tokens

    beside = [{"input_ids": prompts()[0], "request_id": "g", "eos_token_id": -1},
              {"input_ids": prompts()[2], "request_id": "s", "eos_token_id": -1,
               "sampling": Sampling(temperature=0.8)}]
    alone = served(7, [])
    assert served(7, beside) == alone and len(alone) == NEW
    assert served(8, []) != alone
