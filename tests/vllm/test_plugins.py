"""kvmix beside another KV-cache plugin that takes the same slots (``CPU_ATTN``, as a CPU plugin
would, and ``CUSTOM``), installed as a real distribution with a ``vllm.general_plugins`` entry
point and found by vLLM's own loader before kvmix or after it (its folder first or last on the
path). Each order runs in a process of its own, through vLLM's configuration and registry, no
engine: with kvmix configured both members resolve to kvmix's backend (and a backend the other
plugin registers for CUDA refuses to start, naming ``CUSTOM``); without, to the other plugin's
classes, as they would without kvmix.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")

import engines  # noqa: F401  (vLLM's environment, before vLLM)
from engines import tiny_model_folder

TESTS = Path(__file__).resolve().parent
OTHER = '''
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend


class OtherBackend(CPUAttentionBackend):
    """Another plugin's backend: vLLM's CPU backend under its own name."""


class OtherFlash(CPUAttentionBackend):
    """Another plugin's stand-in for a CUDA backend."""


def register():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    for member in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM):
        register_backend(member, "otherkv.OtherBackend")
    register_backend(AttentionBackendEnum.FLASH_ATTN, "otherkv.OtherFlash")
'''
RESOLVE = '''
import json, sys
folder, last = sys.argv[1], sys.argv[2]
if last == "1":
    sys.path.append(sys.argv[3])
import engines
from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.plugins import load_plugins_by_group
from vllm.v1.attention.backends.registry import AttentionBackendEnum

found = [name for name in load_plugins_by_group("vllm.general_plugins")
         if name in ("kvmix", "other")]  # the order vLLM runs them in
resolved = {}
for asked, extra in (("kvmix", {"kvmix": {"method": "kivi2"}}), ("none", {})):
    config = EngineArgs(model=folder, dtype="float32", skip_tokenizer_init=True,
                        max_model_len=512, additional_config=extra).create_engine_config()
    with set_current_vllm_config(config):
        resolved[asked] = {m.name: m.get_class().__name__
                           for m in (AttentionBackendEnum.CPU_ATTN, AttentionBackendEnum.CUSTOM)}
        flash = AttentionBackendEnum.FLASH_ATTN.get_class()
        resolved[asked]["FLASH_ATTN"] = flash.__name__
        if asked == "kvmix":  # what vLLM's CUDA platform asks of a backend it considers
            try:
                flash.validate_configuration()
            except ValueError as error:
                resolved[asked]["FLASH_ATTN"] = "refused: " + str(error)[:60]
print(json.dumps({"found": found, "resolved": resolved}))
'''


@pytest.fixture(scope="module")
def other_plugin(tmp_path_factory):
    """A folder holding the other plugin's module and its distribution's metadata."""
    folder = tmp_path_factory.mktemp("other-plugin")
    (folder / "otherkv.py").write_text(OTHER)
    info = folder / "otherkv-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: otherkv\nVersion: 1.0\n")
    (info / "top_level.txt").write_text("otherkv\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nother = otherkv:register\n")
    return folder


@pytest.fixture(scope="module")
def tiny_folder():
    with tiny_model_folder() as folder:
        yield folder


@pytest.mark.parametrize("last", [False, True], ids=["found-before-kvmix", "found-after-kvmix"])
def test_kvmix_runs_where_configured_and_the_other_plugin_everywhere_else(
        other_plugin, tiny_folder, last):
    path = [str(TESTS)] + ([] if last else [str(other_plugin)])
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", RESOLVE, tiny_folder, str(int(last)),
                           str(other_plugin)], capture_output=True, text=True, env=env,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["found"] == (["kvmix", "other"] if last else ["other", "kvmix"])
    kvmix = {"CPU_ATTN": "KvmixBackend", "CUSTOM": "KvmixBackend"}
    other = {"CPU_ATTN": "OtherBackend", "CUSTOM": "OtherBackend", "FLASH_ATTN": "OtherFlash"}
    configured = result["resolved"]["kvmix"]
    assert configured.pop("FLASH_ATTN").startswith("refused: kvmix is configured")
    assert configured == kvmix and result["resolved"]["none"] == other
    if last:  # the plugin that came after is named in vLLM's log
        assert "otherkv registers the CPU_ATTN attention backend" in done.stderr
