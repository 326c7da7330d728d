"""The capacity planner: architectures, bytes from the same formulas as a real cache, the limits
it reports, the roofline's direction, and bad input."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from conftest import tiny_llama
from helpers import method_string

import kvmix
from kvmix.capacity import (
    bound,
    device,
    kv_bytes,
    max_batch,
    max_tokens,
    parse_memory,
    planned,
    roofline,
)
from kvmix.cli import main
from kvmix.methods import method_names
from kvmix.models.catalog import architecture, bundled, from_config

PUBLISHED = {"llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "mistral-7b": 7.25e9,
             "qwen2.5-7b": 7.62e9, "qwen2.5-14b": 14.77e9, "qwen2.5-32b": 32.76e9,
             "qwen3-8b": 8.19e9, "smollm2": 134.5e6}
PLANNABLE = [m for m in method_names() if m != "wush"]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_bundled_parameter_counts_match_the_published_ones(name):
    assert architecture(name).parameters == pytest.approx(PUBLISHED[name], rel=0.005)


@pytest.mark.parametrize("overrides", [{"sliding_window": 24}, {"sliding_window": None},
                                       {"layer_types": ["sliding_attention", "full_attention"],
                                        "sliding_window": 24}])
def test_layer_kinds_are_read_as_transformers_reads_them(overrides):
    """A window without layer types (Mistral) makes every layer sliding, as transformers' own
    caches have it; explicit layer types win."""
    from transformers import MistralConfig
    from transformers.cache_utils import get_layer_types_and_kwargs

    config = MistralConfig(num_hidden_layers=2, **overrides)
    kinds, _ = get_layer_types_and_kwargs(config)
    assert from_config(config.to_dict(), "m").layer_types == tuple(kinds)


def test_a_window_turned_off_leaves_full_layers():
    """Qwen2's config.json keeps a sliding_window beside use_sliding_window: false."""
    arch = from_config({"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                        "intermediate_size": 96, "vocab_size": 97, "sliding_window": 4096,
                        "use_sliding_window": False}, "qwen2-like")
    assert arch.layer_types == ("full_attention",) * 2


def test_gemma3_sliding_layers_hold_their_window_not_the_context():
    """Gemma-3 keeps one global layer in six: beyond the window, only those ten layers grow."""
    arch = architecture("gemma-3-27b")
    assert arch.layer_types.count("full_attention") == 10 and arch.sliding_window == 1024
    every_global = dataclasses.replace(arch, layer_types=("full_attention",) * arch.layers)
    method = bound("kivi2", arch)

    def growth(a):  # bytes 8K more tokens add, beyond the window
        return sum(kv_bytes(method, a, 1, 16384, torch.float16).values()) - sum(
            kv_bytes(method, a, 1, 8192, torch.float16).values())

    assert growth(arch) == pytest.approx(growth(every_global) * 10 / arch.layers, rel=1e-9)
    short, long = (kv_bytes(method, arch, 1, n, torch.float16)["blocks"] for n in (512, 8192))
    assert long < 16 * short  # 16× the tokens: the sliding layers' pages stop at the window


def test_a_user_config_json_is_read_and_a_broken_one_named(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "num_key_value_heads": 2,
                                "intermediate_size": 96, "vocab_size": 97}))
    arch = architecture(str(path))
    assert (arch.layers, arch.kv_heads, arch.head_dim) == (2, 2, 16)
    with pytest.raises(ValueError, match="lacks hidden_size, vocab_size"):
        from_config({"num_hidden_layers": 2, "num_attention_heads": 4,
                     "intermediate_size": 96}, "broken")
    with pytest.raises(ValueError, match=r"model='nosuch' is neither a bundled config \(gemma"):
        architecture("nosuch")


@pytest.mark.parametrize("name", PLANNABLE)
@pytest.mark.parametrize("batch, tokens", [(1, 40), (2, 97), (3, 200)])
def test_planned_bytes_are_what_a_real_cache_holds(name, batch, tokens):
    """The tiny Llama through kvmix: the planner, from its config alone, says what the cache
    holds, its pool sized up front (within 1%: the planner does not know the weight norms a
    real cache keeps)."""
    model = tiny_llama()
    method = method_string(name)
    cache = kvmix.make_cache(model, method, max_batch=batch, max_tokens=tokens)
    ids = torch.randint(1, 97, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
    arch = from_config(model.config.to_dict(), "tiny")
    plan = kv_bytes(bound(method, arch), arch, batch, tokens, torch.float32)
    assert sum(plan.values()) == pytest.approx(cache.nbytes(), rel=0.01)
    blocks = sum(v for k, v in cache.nbytes_breakdown().items()
                 if k in ("codes", "scales", "zeros", "full"))
    assert plan["blocks"] == pytest.approx(blocks, abs=0)


@pytest.mark.parametrize("name", ["full", "kivi2", "pnmix1", "kitty"])
@pytest.mark.parametrize("prompt, steps", [(40, 0), (70, 23), (200, 9)])
def test_planned_bytes_of_sliding_window_layers_are_what_a_real_cache_holds(name, prompt, steps):
    """A sliding-window layer beside a full one: after a prompt and decode steps the planner
    says, by part, what the cache holds (its pool grown on demand: free pages aside)."""
    model = tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=24)
    method = method_string(name)
    cache = kvmix.make_cache(model, method, backend="torch")
    ids = torch.randint(1, 97, (2, prompt + steps), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids[:, :prompt], cache=cache, use_cache=True)
        for t in range(prompt, prompt + steps):
            model(ids[:, t : t + 1], cache=cache, use_cache=True)
    arch = from_config(model.config.to_dict(), "tiny")
    plan = kv_bytes(bound(method, arch), arch, 2, prompt + steps, torch.float32)
    held = cache.nbytes_breakdown()
    blocks = sum(v for k, v in held.items() if k in ("codes", "scales", "zeros", "full"))
    assert plan["blocks"] == pytest.approx(blocks, abs=0)
    assert plan["sink"] + plan["residual"] == held["sink"] + held["residual"]
    sliding = cache.layers[0].store  # the pages that meet the window of 24, groups of 8
    assert all(len(pages) <= 4 for pages in sliding.pages) and sliding.pool.used <= 8


@pytest.mark.parametrize("name", ["full", "kivi2", "pnmix1"])
def test_limits_are_the_edge_of_fitting(name):
    arch, memory = architecture("llama-3.1-8b"), device("a100-40gb").memory
    method = bound(name, arch)
    args = (16, torch.float16, 1.5 * 2**30)
    top = max_batch(method, arch, 8192, *args, memory)
    assert planned(method, arch, top, 8192, *args).total <= memory
    assert planned(method, arch, top + 1, 8192, *args).total > memory
    longest = max_tokens(method, arch, 8, 100, *args, memory)
    assert planned(method, arch, 8, 100 + longest, *args).total <= memory
    assert planned(method, arch, 8, 100 + longest + 1, *args).total > memory


def test_fewer_bits_fit_more_and_decode_faster_by_the_roofline():
    arch, target = architecture("qwen3-8b"), device("a100-40gb")
    args = (16, torch.float16, 1.5 * 2**30)
    full, kivi2 = bound("full", arch), bound("kivi2", arch)
    assert max_batch(kivi2, arch, 8192, *args, target.memory) > 4 * max_batch(
        full, arch, 8192, *args, target.memory)

    def speed(method, batch):
        return roofline(planned(method, arch, batch, 8192, *args), arch, batch, 8192,
                        target.bandwidth, target.flops)

    # at batch 16 the float cache outweighs the weights, so 2-bit KV pays; at batch 1 the
    # weights dominate the bytes read and the gain is small
    assert speed(kivi2, 16) > 1.5 * speed(full, 16)
    assert speed(full, 1) < speed(kivi2, 1) < 1.1 * speed(full, 1)


@pytest.mark.parametrize("text, expected", [("40GB", 40e9), ("40GiB", 40 * 2**30),
                                            ("512 MiB", 512 * 2**20), ("1.5gib", 1.5 * 2**30)])
def test_memory_sizes_parse(text, expected):
    assert parse_memory(text) == expected


@pytest.mark.parametrize("argv, message", [
    (["plan", "--model", "gpt-5"], r"model='gpt-5' is neither a bundled config"),
    (["plan", "--hardware", "tpu"], "hardware='tpu' is unknown; valid: a100-40gb"),
    (["plan", "--memory", "forty"], "memory='forty' does not parse"),
    (["plan", "--overhead=-1GB"], "overhead=.-1GB. does not parse; write a size of 0 or more"),
    (["plan", "--batch", "0"], "batch=0 is invalid; expected an integer >= 1"),
    (["plan", "--new-tokens", "-5"], "new_tokens=-5 is invalid"),
    (["plan", "--weight-bits", "3"], "weight_bits=3 is invalid; valid: 16, 8, 4"),
    (["plan", "--memory", "10GB"], "weights .* and overhead .* alone exceed the memory"),
    (["plan", "--methods", "kxvy:budget=3"], "budget mode allocates from the model's weights"),
])
def test_bad_plans_fail_with_a_clear_error(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


def test_an_overhead_of_zero_leaves_the_memory_to_weights_and_cache(tmp_path):
    argv = ["plan", "--model", "qwen3-8b", "--hardware", "a100-40gb", "--methods", "full",
            "--batch", "8", "--new-tokens", "4096"]
    main([*argv, "--overhead", "0", "--out", str(tmp_path / "none")])
    main([*argv, "--overhead", "2GB", "--out", str(tmp_path / "some")])
    none, some = (json.loads((tmp_path / d / "results.json").read_text())["rows"][0]
                  for d in ("none", "some"))
    assert none["overhead_bytes"] == 0 and some["overhead_bytes"] == 2e9
    assert none["total_bytes"] == some["total_bytes"] - 2e9
    assert none["max_batch"] >= some["max_batch"]


def test_the_command_writes_rows_and_a_capacity_plot(tmp_path):
    main(["plan", "--model", "qwen3-8b", "--hardware", "a100-40gb", "--methods",
          "full,pnmix1", "--batch", "32", "--new-tokens", "8192", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    full, pnmix = saved["rows"]
    for key in ("method", "kv_bytes", "weight_bytes", "total_bytes", "fits", "max_batch",
                "max_tokens"):
        assert key in full
    assert not full["fits"] and pnmix["fits"] and pnmix["max_batch"] > 32 > full["max_batch"]
    assert (tmp_path / "capacity.png").stat().st_size > 10_000
    assert "qwen3-8b" in bundled() and saved["architecture"]["layers"] == 36


def test_a_bare_memory_size_plans_bytes_and_makes_no_speed_estimate(capsys):
    """``--memory`` names no device: no bandwidth or FLOPs to estimate speed from (once a
    division by zero), so the speed columns are empty while the sizes are planned."""
    from kvmix.commands.plan import PlanConfig, run_plan

    rows = run_plan(PlanConfig(model="gemma-3-27b", methods=["full", "kivi2"], batch=8,
                               prompt_tokens=0, new_tokens=32768, memory="80GB"))
    assert [r["est_tokens_per_s_max_batch"] for r in rows] == [None, None]
    assert rows[1]["max_batch"] > 4 * rows[0]["max_batch"] > 0
