"""``kvmix loadtest``'s vLLM rows, without vLLM: settings checked before any server starts, and
a missing vLLM environment reported in its row. (vLLM's server itself, as these rows start it,
is tested in the vLLM environment: tests/vllm/test_server.py.)"""

from __future__ import annotations

import pytest
from conftest import saved_model

from kvmix.cli import main
from kvmix.commands.loadtest import LoadtestConfig, run_loadtest
from kvmix.engines.vllm import server as vllm_server
from kvmix.models.loading import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def test_a_vllm_row_names_a_kvmix_method_or_vllms_own_cache():
    assert vllm_server.parse("vllm:pnmix1") == "pnmix1"
    assert vllm_server.parse("vllm:kxvy:key_bits=4,value_bits=2") == \
        "kxvy:key_bits=4,value_bits=2"
    assert vllm_server.parse("vllm:fp8") == "fp8"
    with pytest.raises(ValueError, match="method='vllm:kivi9' is invalid; expected vllm:METHOD"):
        vllm_server.parse("vllm:kivi9")


def test_a_vllm_row_names_the_plugins_settings_after_its_method():
    setting = "vllm:kxvy:key_bits=4,value_bits=2@values=token,staging=float32"
    assert vllm_server.parse(setting) == "kxvy:key_bits=4,value_bits=2"
    assert vllm_server.plugin_settings(setting) == {"values": "token", "staging": "float32"}
    assert vllm_server.plugin_settings("vllm:kivi2") == {}
    with pytest.raises(ValueError, match="values='tokens' is invalid; valid: group, token"):
        vllm_server.parse("vllm:kivi2@values=tokens")
    with pytest.raises(ValueError, match="not vLLM's own fp8 cache's"):
        vllm_server.parse("vllm:fp8@values=token")


def test_loadtest_refuses_a_bad_vllm_row_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest", "--methods", "kivi2", "--baselines", "vllm:kivi9", "--requests", "1"])
    assert exit_.value.code == 2 and "vllm:kivi9" in capsys.readouterr().err


def test_a_missing_vllm_environment_is_reported_in_its_row(tmp_path, tokenizer):
    with saved_model(tokenizer) as folder:
        rows = run_loadtest(LoadtestConfig(
            methods=[], baselines=["vllm:kivi2"], model=folder, memory="20MB", requests=[2],
            concurrency=[2], prompt_tokens=16, new_tokens=[4],
            vllm_python=str(tmp_path / "no-python")))
    assert len(rows) == 1 and "make vllm" in rows[0]["error"]
    assert rows[0]["method"] == "vllm:kivi2"


def test_a_kvmix_row_gives_vllms_pages_the_budget_less_the_plugins_staging(tmp_path, tokenizer):
    """The plugin stages every running sequence's open group beside vLLM's cache: a vllm:METHOD
    row caps the sequences at the clients' number and gives vLLM's pages the rest of the
    budget, so the row holds what ``kvmix serve`` holds in the same bytes (its residuals
    counted); vLLM's own caches stage nothing."""
    from transformers import AutoConfig

    memory = 10**8
    with saved_model(tokenizer) as folder:
        config = AutoConfig.from_pretrained(folder)
        head_dim = getattr(config, "head_dim", None) or \
            config.hidden_size // config.num_attention_heads
        # kivi2's 32-token group, keys and values in float16, every layer
        one = config.num_hidden_layers * 32 * 2 * config.num_key_value_heads * head_dim * 2
        assert vllm_server.staging_bytes(folder, "vllm:kivi2", 1) == one
        assert vllm_server.staging_bytes(folder, "vllm:fp8", 24) == 0
        server = vllm_server.VllmServer("python", folder, "vllm:kivi2", memory, 256,
                                        tmp_path / "log", sequences=24)
        command = server.command(0)
        assert server.staging == 24 * one
        assert command[command.index("--kv-cache-memory-bytes") + 1] == str(memory - 24 * one)
        assert command[command.index("--max-num-seqs") + 1] == "24"
        # values="token": keys alone staged, the setting passed to the plugin
        assert vllm_server.staging_bytes(folder, "vllm:kivi2@values=token", 1) == one // 2
        token = vllm_server.VllmServer("python", folder, "vllm:kivi2@values=token", memory, 256,
                                       tmp_path / "log", sequences=24).command(0)
        assert '"values": "token"' in token[token.index("--additional-config") + 1]
        with pytest.raises(vllm_server.VllmMissing, match="staging for 24 sequences"):
            vllm_server.VllmServer("python", folder, "vllm:kivi2", 24 * one, 256,
                                   tmp_path / "log", sequences=24)
