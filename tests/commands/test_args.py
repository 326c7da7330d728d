"""Old spellings of renamed flags: accepted for one release into the new flag's destination,
hidden from --help, with a warning naming the new spelling; loadtest's baselines given among
its methods are moved to --baselines the same way."""

from __future__ import annotations

import json
import re

import pytest

from kvmix.cli import main
from kvmix.commands import parser as make_parser
from kvmix.commands import subcommands
from kvmix.commands.loadtest import LoadtestConfig, _moved_baselines

RENAMED = [  # (command, old spelling, new spelling, value given, destination, value stored)
    ("plan", "--device", "--hardware", "h100-80gb", "hardware", "h100-80gb"),
    ("plan", "--prompt", "--prompt-tokens", "256", "prompt_tokens", 256),
    ("plan", "--tokens", "--new-tokens", "512", "new_tokens", 512),
    ("bench", "--prompt", "--prompt-tokens", "64,128", "prompt_tokens", "64,128"),
    ("bench", "--tokens", "--budget-tokens", "32", "budget_tokens", 32),
    ("loadtest", "--prompt", "--prompt-tokens", "16", "prompt_tokens", 16),
    ("loadtest", "--tokens", "--new-tokens", "4,8", "new_tokens", "4,8"),
    ("loadtest", "--timeout", "--request-timeout", "2.5", "request_timeout", 2.5),
    ("needle", "--lengths", "--prompt-tokens", "400,500", "prompt_tokens", "400,500"),
    ("eval", "--lengths", "--prompt-tokens", "4096", "prompt_tokens", "4096"),
    ("calibrate", "--data", "--calib-data", "code", "data", "code"),
    ("calibrate", "--tokens", "--calib-tokens", "384", "tokens", 384),
    ("export", "--transform", "--kind", "hadamard", "kind", "hadamard"),
]


@pytest.mark.parametrize("command, old, new, given, dest, stored", RENAMED)
def test_an_old_spelling_stores_into_the_new_flag_with_a_warning(command, old, new, given, dest,
                                                                  stored, capsys):
    required = ["--plan", "kivi2", "--out", "x"] if command == "export" else []
    args = make_parser().parse_args([command, *required, old, given])
    assert getattr(args, dest) == stored
    assert capsys.readouterr().err == (f"kvmix: warning: {old} is deprecated, use {new} "
                                       "(accepted until the next release)\n")
    again = make_parser().parse_args([command, *required, new, given])
    assert getattr(again, dest) == stored and capsys.readouterr().err == ""


@pytest.mark.parametrize("command, old, new", sorted({r[:3] for r in RENAMED}))
def test_an_old_spelling_is_hidden_from_help(command, old, new):
    text = subcommands(make_parser())[command].format_help()
    assert re.search(rf"(?<![\w-]){old}(?![\w-])", text) is None
    assert re.search(rf"(?<![\w-]){new}(?![\w-])", text)


def test_an_old_spelling_reaches_the_saved_configuration(tmp_path, capsys):
    main(["plan", "--device", "h100-80gb", "--tokens", "1024", "--methods", "full",
          "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())["config"]
    assert saved["hardware"] == "h100-80gb" and saved["new_tokens"] == 1024
    assert "device" not in saved and "tokens" not in saved
    assert capsys.readouterr().err.count("is deprecated") == 2


def test_baselines_among_loadtests_methods_move_to_baselines_with_a_warning(capsys):
    old = _moved_baselines(LoadtestConfig(methods=["kivi2", "transformers", "llama.cpp:f16",
                                                   "vllm:auto"]))
    assert old.methods == ["kivi2"]
    assert old.baselines == ["transformers", "llama.cpp:f16", "vllm:auto"]  # no default added
    said = capsys.readouterr().err
    assert "baselines in --methods (transformers,llama.cpp:f16,vllm:auto) is deprecated" in said
    assert "use --baselines transformers,llama.cpp:f16,vllm:auto" in said
    both = _moved_baselines(LoadtestConfig(methods=["kivi2", "llama.cpp:f16"],
                                           baselines=["vllm:auto"]))
    assert both.methods == ["kivi2"] and both.baselines == ["vllm:auto", "llama.cpp:f16"]
    new = LoadtestConfig(methods=["kivi2"], baselines=["llama.cpp:f16"])
    assert _moved_baselines(new) is new and capsys.readouterr().err.count("deprecated") == 1


@pytest.mark.parametrize("argv, message", [
    (["--baselines", "dynamic"], "baselines ['dynamic'] are unknown; valid: transformers"),
    (["--methods", "kivi2,nosuch"], "unknown method 'nosuch'"),
])
def test_loadtest_refuses_unknown_servers_before_any_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["loadtest", *argv])
    assert stop.value.code == 2 and message in capsys.readouterr().err
