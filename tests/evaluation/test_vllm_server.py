"""``kvmix loadtest``'s vLLM rows, without vLLM: settings checked before any server starts, and
a missing vLLM environment reported in its row. (vLLM's server itself, as these rows start it,
is tested in the vLLM environment: tests/vllm/test_server.py.)"""

from __future__ import annotations

import pytest
from conftest import saved_model

from kvmix.cli import main
from kvmix.commands.loadtest import LoadtestConfig, run_loadtest
from kvmix.evaluation import vllm_server
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


def test_loadtest_refuses_a_bad_vllm_row_before_any_server_starts(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["loadtest", "--methods", "kivi2,vllm:kivi9", "--requests", "1"])
    assert exit_.value.code == 2 and "vllm:kivi9" in capsys.readouterr().err


def test_a_missing_vllm_environment_is_reported_in_its_row(tmp_path, tokenizer):
    with saved_model(tokenizer) as folder:
        rows = run_loadtest(LoadtestConfig(
            methods=["vllm:kivi2"], model=folder, memory="20MB", requests=[2], concurrency=[2],
            prompt=16, tokens=[4], vllm_python=str(tmp_path / "no-python")))
    assert len(rows) == 1 and "make vllm" in rows[0]["error"]
    assert rows[0]["method"] == "vllm:kivi2"
