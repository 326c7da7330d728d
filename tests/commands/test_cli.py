import pytest

from kvmix.cli import main
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
    (["bench", "--baselines", "paged"], "baselines ['paged'] are unknown; valid: dynamic"),
    (["bench", "--prompt", "1024,x"], "prompt='1024,x' is invalid; expected comma-separated int"),
    (["bench", "--rounds", "0"], "rounds=0 is invalid; expected >= 1"),
])
def test_compare_rejects_bad_input_before_loading_the_model(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_method_lists_keep_overrides_with_their_method():
    assert split_methods("full,kivi2,kxvy:key_bits=4,value_bits=2,kxvy:key_bits=2") == [
        "full", "kivi2", "kxvy:key_bits=4,value_bits=2", "kxvy:key_bits=2"]


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
