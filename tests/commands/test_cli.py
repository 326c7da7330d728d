import re
import sys

import pytest

from kvmix.cli import main
from kvmix.commands import parser as make_parser
from kvmix.commands import subcommands
from kvmix.evaluation.data import load_text, token_ids
from kvmix.methods import split_methods


def test_methods_lists_every_method_and_preset(capsys):
    main(["methods"])
    out = capsys.readouterr().out
    for name in ("full", "kivi", "kxvy", "kivi2", "kivi4", "value_group"):
        assert name in out


@pytest.mark.parametrize("argv, message", [
    (["compare", "--methods", "full,nosuch"], "unknown method 'nosuch'"),
    (["compare", "--context", "0"], "context=0 is invalid"),
    (["compare", "--methods", "kivi:key_bits=8"], "key_bits=8 is not supported"),
    (["compare", "--backend", "gpu"], "backend='gpu' is invalid; valid: auto, torch, cpu"),
    (["compare", "--engine", "sglang"], "engine='sglang' is invalid; valid: kvmix, vllm"),
    (["compare", "--engine", "vllm", "--vllm-prefill", "float"],
     "vllm_prefill='float' is invalid; valid: exact, decode"),
    (["compare", "--engine", "vllm", "--vllm-python", "/no/python"],
     "vllm_python='/no/python' does not exist: build the vLLM environment with `make vllm`"),
    (["compare", "--engine", "vllm", "--vllm-python", sys.executable, "--methods",
      "kivi2:sink=4"], "--engine vllm sets sink itself"),
    (["compare", "--engine", "vllm", "--vllm-python", sys.executable, "--methods",
      "kivi2@values=tokens"], "values='tokens' is invalid; valid: group, token"),
    (["compare", "--engine", "vllm", "--vllm-python", sys.executable, "--methods",
      "full@values=token"], "full is vLLM's own cache: no plugin settings after '@'"),
    (["bench", "--baselines", "paged"], "baselines ['paged'] are unknown; valid: dynamic"),
    (["bench", "--prompt-tokens", "1024,x"],
     "prompt_tokens='1024,x' is invalid; expected comma-separated int"),
    (["bench", "--rounds", "0"], "rounds=0 is invalid; expected >= 1"),
    (["bench", "--shape", "32,5,128"], "shape='32,5,128' is invalid; expected positive heads"),
    (["bench", "--shape", "32,8"], "shape='32,8' is invalid; expected HEADS,KV_HEADS,HEAD_DIM"),
    (["bench", "--shape", "4,2,32", "--batch", "0"], "batch=[0] is invalid; expected values"),
])
def test_compare_rejects_bad_input_before_loading_the_model(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_method_lists_keep_overrides_with_their_method():
    assert split_methods("full,kivi2,kxvy:key_bits=4,value_bits=2,kxvy:key_bits=2") == [
        "full", "kivi2", "kxvy:key_bits=4,value_bits=2", "kxvy:key_bits=2"]
    assert split_methods("vllm:auto,vllm:pnmix1@values=token,staging=float32,kivi2@values=token"
                         ) == ["vllm:auto", "vllm:pnmix1@values=token,staging=float32",
                               "kivi2@values=token"]


def test_builtin_texts_are_long_and_distinct():
    prose, code = load_text("prose"), load_text("code")
    assert len(prose) > 300_000 and "def " in code and prose[:1000] != code[:1000]


def test_unknown_data_and_short_text_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="neither one of"):
        load_text(str(tmp_path / "missing.txt"))

    class Tok:
        def __call__(self, text, **kwargs):
            import torch

            return type("E", (), {"input_ids": torch.zeros(1, len(text.split()), dtype=int)})

    with pytest.raises(ValueError, match="has 3 tokens; 10 are needed"):
        token_ids(Tok(), "a b c", 10)


def test_the_op_bench_times_synthetic_caches_beside_sdpa_and_the_float_kernel(tmp_path):
    import json

    from kvmix.evaluation.inputs import DEFAULT_MODEL

    main(["bench", "--shape", "4,2,32", "--context", "1200", "--batch", "1,2", "--methods",
          "kivi2,pnmix1", "--backend", "torch", "--new-tokens", "2", "--rounds", "2",
          "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    rows = {(r["method"], r["batch"]): r for r in results["rows"]}
    assert set(rows) == {(m, b) for m in ("sdpa", "full", "kivi2", "pnmix1") for b in (1, 2)}
    assert results["model"]["shape"] == {"heads": 4, "kv_heads": 2, "head_dim": 32}
    assert results["model"]["name"] != DEFAULT_MODEL and "versions" in results
    for batch in (1, 2):  # float32 K/V of 1,200 tokens, 2 heads × 32, per sequence, for SDPA
        assert rows["sdpa", batch]["nbytes"] is None
        full, kivi = rows["full", batch]["nbytes"], rows["kivi2", batch]["nbytes"]
        assert full >= batch * 2 * 1200 * 2 * 32 * 4 and kivi < full / 4
        float_bytes = batch * 2 * 1200 * 2 * 32 * 4
        for name in ("sdpa", "full", "kivi2", "pnmix1"):  # the bytes a step reads, over its time
            row = rows[name, batch]
            read = float_bytes if name == "sdpa" else row["nbytes"]
            assert row["gb_per_s"] == pytest.approx(read / row["us_per_step"] / 1e3)
            copy = rows["sdpa", 1]["copy_gb_per_s"] * 1e9  # measured once per run
            assert row["limit_us"] == pytest.approx(1e6 * read / copy)
            assert row["of_limit"] == pytest.approx(row["limit_us"] / row["us_per_step"])
            assert row["vs_sdpa"] == pytest.approx(rows["sdpa", batch]["us_per_step"] /
                                                   row["us_per_step"])
        assert rows["sdpa", batch]["encode_us"] is None  # nothing to encode
        assert isinstance(rows["kivi2", batch]["encode_us"], float)
    assert rows["kivi2", 2]["nbytes"] > 1.9 * rows["kivi2", 1]["nbytes"]


def test_version_prints_the_packages_version(capsys):
    import kvmix

    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out == f"kvmix {kvmix.__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", kvmix.__version__)


def test_every_flag_of_every_command_has_help():
    commands = subcommands(make_parser())
    assert len(commands) == 20
    bare = [f"kvmix {name} {'/'.join(action.option_strings) or action.dest}"
            for name, command in commands.items() for action in command._actions
            if not (action.help or "").strip()]
    assert bare == []
    assert all(command.description for command in commands.values())


def test_help_lists_every_command_under_its_group(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "The ``kvmix`` command line" not in out  # the module docstring is not the help
    groups = [line for line in out.splitlines() if line.endswith(":") and
              not line.startswith(" ")]
    assert groups[:3] == ["measure methods against the float cache:",
                          "choose, deploy and serve:", "research studies:"]
    studies = out.split("research studies:")[1].split("\n\n")[0]
    assert {line.split()[0] for line in studies.strip().splitlines()} == {
        "sweep", "criteria", "pairscore", "keyfirst", "norms", "recon", "transforms"}
    for name in subcommands(make_parser()):
        assert re.search(rf"^  {name} ", out, re.MULTILINE), name
