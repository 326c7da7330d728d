"""Loading: ``dtype="auto"`` follows the checkpoint on accelerators; the GGUF conversion's
progress bar only draws on a terminal; a GGUF file's conversion is keyed by the file and read
only once complete (the conversion itself, bit for bit: ``test_integration``)."""

from __future__ import annotations

import os

import torch
from conftest import tiny_llama

from kvmix.models import loading
from kvmix.models.loading import checkpoint_dtype, resolve_dtype, terminal_only_progress


def test_auto_dtype_is_the_checkpoints_on_accelerators_and_float32_on_the_cpu(tmp_path):
    model = tiny_llama().to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    declared = checkpoint_dtype(str(tmp_path))
    assert declared == torch.bfloat16
    assert resolve_dtype("auto", "cuda", declared) == torch.bfloat16  # not float16: overflow
    assert resolve_dtype("auto", "cpu", declared) == torch.float32
    assert resolve_dtype("auto", "cuda", None) == torch.float16  # nothing declared
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16


def test_the_gguf_progress_bar_is_off_when_stderr_is_not_a_terminal():
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    plain = gguf_utils.tqdm
    with terminal_only_progress():
        bar = gguf_utils.tqdm(range(3))  # pytest captures stderr: not a terminal
        assert bar.disable
        bar.close()
    assert gguf_utils.tqdm is plain
    with open("/dev/null", "w") as sink:
        drawn = plain(range(3), file=sink)
        assert not drawn.disable  # as transformers draws it unpatched
        drawn.close()


def test_a_gguf_files_conversion_is_keyed_by_the_file_and_read_once_complete(tmp_path,
                                                                            monkeypatch):
    monkeypatch.setenv("KVMIX_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    target = loading._conversion(str(tmp_path), gguf.name)
    assert target.parent == tmp_path / "cache" / "models" and target.name.startswith("m-")
    assert loading._readable(str(gguf)) == (str(tmp_path), {"gguf_file": "m.gguf"})
    target.mkdir(parents=True)  # a conversion under way (or interrupted) is not read
    assert loading._readable(str(gguf))[1] == {"gguf_file": "m.gguf"}
    (target / loading.DONE).write_text(str(gguf))
    assert loading._readable(str(gguf)) == (str(target), {})
    assert loading.converted(str(tmp_path), gguf.name) == target  # complete: reused as is
    os.utime(gguf, ns=(1, 1))  # the file changed: another conversion
    assert loading._conversion(str(tmp_path), gguf.name) != target


def test_a_gguf_files_tokenizer_is_read_once_and_saved(tmp_path, monkeypatch):
    """The default model's tokenizer from its GGUF file (seconds) is saved beside where its
    conversion goes and read from there afterwards: the same tokens, specials and template."""
    from transformers import AutoTokenizer

    monkeypatch.setenv("KVMIX_CACHE", str(tmp_path))
    folder, gguf = loading.smollm2_location()
    reads, read = [], AutoTokenizer.from_pretrained

    def recorded(*args, **kwargs):
        reads.append((kwargs.get("gguf_file"), read(*args, **kwargs)))
        return reads[-1][1]

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", recorded)
    first, again = loading.load_tokenizer(), loading.load_tokenizer()
    assert [file for file, _ in reads] == [gguf, None, None]  # the file once, then the folder
    direct = reads[0][1]  # as transformers reads it from the file
    assert not (tmp_path / "models" / loading._conversion(folder, gguf).name).exists()
    text = "héllo wörld 😀 — <|im_start|>user\nok<|im_end|>"
    chat = [{"role": "user", "content": "hi"}]
    for tokenizer in (first, again):
        assert tokenizer(text).input_ids == direct(text).input_ids
        assert (tokenizer.eos_token, len(tokenizer)) == (direct.eos_token, len(direct))
        assert (tokenizer.apply_chat_template(chat, tokenize=False)
                == direct.apply_chat_template(chat, tokenize=False))
