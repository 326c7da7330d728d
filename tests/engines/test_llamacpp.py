"""llama.cpp as an anchor: its cache bytes and slot plan, the refusals before anything starts,
a missing build reported in its row while the others run, and — where ``make engine`` has
built it — the real ``llama-server`` with 2 slots and a handful of tokens, and the batch-1
decoder through the Python bindings."""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest
from transformers import LlamaConfig

from kvmix.bench.load import run_level
from kvmix.commands.bench import BenchConfig, run_bench
from kvmix.commands.loadtest import LoadtestConfig, run_loadtest
from kvmix.engines.llamacpp.build import EngineMissing, bindings, server_binary
from kvmix.engines.llamacpp.decoder import Decoder
from kvmix.engines.llamacpp.server import LlamaServer, reported_cache_bytes
from kvmix.engines.llamacpp.slots import cache_bytes_per_token, fit_slots, parse_types

# 2 layers x 2 KV heads x 64: f16 keeps 2 bytes per element, q4_0 18 bytes per 32 elements.
CONFIG = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                     hidden_size=256, head_dim=64)


def built() -> bool:
    try:
        server_binary()
    except EngineMissing:
        return False
    return True


@pytest.fixture(scope="module")
def tokenizer():
    from kvmix.models.loading import load_tokenizer

    return load_tokenizer()


@pytest.fixture
def loaded_once(tokenizer, monkeypatch):
    """loadtest's tokenizer is the module's (the GGUF's vocabulary loads once)."""
    monkeypatch.setattr("kvmix.models.loading.load_tokenizer", lambda name: tokenizer)


needs_server = pytest.mark.skipif(not built(), reason="llama-server is not built here (make "
                                  "engine builds it; not in CI: about 25 minutes on 2 cores)")


@pytest.mark.parametrize(("k", "v", "expected"), [("f16", "f16", 2 * 2 * 128 * 2),
                                                  ("q4_0", "q4_0", 2 * 2 * 4 * 18),
                                                  ("q8_0", "q4_0", 2 * (4 * 34 + 4 * 18))])
def test_cache_bytes_per_token_follow_ggml_row_sizes(k, v, expected):
    assert cache_bytes_per_token(CONFIG, k, v) == expected


def test_slots_are_the_most_whose_padded_cache_fits():
    per_token = cache_bytes_per_token(CONFIG, "f16", "f16")  # 1024
    plan = fit_slots(CONFIG, "f16", "f16", 1100 * per_token, 300, most=8)
    # a request of 300 tokens takes a slot of 512 cells: two fit in 1100 cells, three do not
    assert (plan.slots, plan.per_slot, plan.cells, plan.bytes) == (2, 512, 1024,
                                                                    1024 * per_token)
    assert fit_slots(CONFIG, "f16", "f16", 1100 * per_token, 300, most=1).slots == 1
    fractional = fit_slots(CONFIG, "f16", "f16", 1100.0 * per_token, 300, most=8)
    assert type(fractional.slots) is int and type(fractional.cells) is int  # flags take ints
    with pytest.raises(ValueError, match=r"fits no llama\.cpp slot"):
        fit_slots(CONFIG, "f16", "f16", 255 * per_token, 10, most=8)


def test_cache_types_parse_or_are_refused_by_name():
    assert parse_types("llama.cpp:q4_0") == ("q4_0", "q4_0")
    assert parse_types("llama.cpp:q8_0/f16") == ("q8_0", "f16")
    with pytest.raises(ValueError, match=r"llama\.cpp:q3_k.*q4_0"):
        parse_types("llama.cpp:q3_k")


def test_reported_cache_bytes_read_from_the_load_log():
    log = ("llama_kv_cache: size =    6.00 MiB (   256 cells,  30 layers,  2/1 seqs), K (q4_0):"
           "    3.00 MiB, V (q4_0):    3.00 MiB\n")
    assert reported_cache_bytes(log) == 6 * 2**20
    assert reported_cache_bytes("no cache here") is None


def test_loadtest_refuses_before_anything_starts(tmp_path, loaded_once):
    with pytest.raises(ValueError, match="not a GGUF file"):
        run_loadtest(LoadtestConfig(methods=[], baselines=["llama.cpp:f16"], model=str(tmp_path)))
    with pytest.raises(ValueError, match=r"invalid; expected llama\.cpp:TYPE"):
        run_loadtest(LoadtestConfig(methods=["kivi2"], baselines=["llama.cpp:f15"]))
    with pytest.raises(ValueError, match=r"fits no llama\.cpp slot"):
        run_loadtest(LoadtestConfig(methods=[], baselines=["llama.cpp:f16"], memory="1MB",
                                    requests=[2], concurrency=[1], prompt_tokens=16,
                                    new_tokens=[4]))


def test_bench_refuses_llama_cpp_beside_throughput():
    with pytest.raises(ValueError, match="per-prompt bench"):
        run_bench(BenchConfig(baselines=["llama.cpp:f16"], throughput=True))


def test_a_missing_build_is_reported_in_its_row(tmp_path, monkeypatch, loaded_once):
    """No build: the row carries the command to run, and nothing is left behind."""
    monkeypatch.setenv("KVMIX_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(EngineMissing, match="make engine"):
        server_binary()
    rows = run_loadtest(LoadtestConfig(methods=[], baselines=["llama.cpp:q4_0"], memory="20MB",
                                       requests=[2], concurrency=[2], prompt_tokens=16,
                                       new_tokens=[4]))
    assert len(rows) == 1 and "make engine" in rows[0]["error"]
    assert list(tmp_path.iterdir()) == []


def test_missing_bindings_name_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import fails
    bindings.cache_clear()
    try:
        with pytest.raises(EngineMissing, match="pip install 'llama-cpp-python=="):
            bindings()
    finally:
        bindings.cache_clear()


@needs_server
def test_llama_server_serves_two_slots_within_its_planned_cache(tmp_path):
    from kvmix.models.loading import gguf_path, load_config, smollm2_location

    config, _ = load_config()
    per_token = cache_bytes_per_token(config, "q4_0", "q4_0")
    plan = fit_slots(config, "q4_0", "q4_0", 600 * per_token, 64, most=4)
    assert (plan.slots, plan.cells) == (2, 512)
    server = LlamaServer(gguf_path("smollm2"), plan, 2, tmp_path / "server.log")
    with server as url:
        outcomes, _, peaks = asyncio.run(run_level(url, ["The river", "A small house"] * 2,
                                                   [24], concurrency=2, timeout=60))
        process = server.process
    assert process.poll() is not None  # stopped with the block
    assert [o.error for o in outcomes] == [None] * 4
    assert [o.tokens for o in outcomes] == [24] * 4
    assert 1 <= peaks["llamacpp:requests_processing"] <= 2
    assert abs(server.reported_bytes - plan.bytes) <= 0.005 * 2**20  # logged to 0.01 MiB
    assert server.cpu_variant is not None  # a CPU variant chosen at load, not compiled in
    assert smollm2_location()[1] in (tmp_path / "server.log").read_text()


@needs_server
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                    reason="llama.cpp's Python bindings are not installed (make engine)")
def test_the_bindings_decode_as_the_server_does(tmp_path, tokenizer):
    import httpx

    from kvmix.models.loading import gguf_path, load_config

    config, _ = load_config()
    ids = tokenizer("The river ran past the old mill and", return_tensors="pt").input_ids
    decoder = Decoder(gguf_path("smollm2"), config, "f16", "f16", 64, 2)
    token, tokens = decoder(ids).logits[:, -1:].argmax(-1), []
    for _ in range(4):
        tokens.append(int(token))
        token = decoder(token).logits[:, -1:].argmax(-1)
    assert decoder.nbytes() == 256 * cache_bytes_per_token(config, "f16", "f16")
    plan = fit_slots(config, "f16", "f16", decoder.nbytes(), 64, most=1)
    with LlamaServer(gguf_path("smollm2"), plan, 2, tmp_path / "log") as url:
        answer = httpx.post(f"{url}/completion", json={"prompt": ids[0].tolist(),
                                                       "n_predict": 4, "temperature": 0,
                                                       "return_tokens": True}, timeout=60)
    assert answer.json()["tokens"] == tokens
