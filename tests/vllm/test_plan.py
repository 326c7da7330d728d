"""The plugin's step without an engine: a scheduler's steps (prefill chunks, decodes, groups
sealed by either, several rows, a block table out of order) driven through a ``Planner`` and one
``LayerCache``, checked against kvmix's methods called directly — the codes in every page are
the method's ``encode`` of that group (the selection its ``select`` makes from the first
group's queries), and every token's output is attention over the decoded pages and the exact
float tail."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import TINY
from helpers import HQ, PAIRS, D, H, assert_near, method_string, op_tolerance
from transformers import LlamaConfig

from kvmix.core.quantizers import dequantize_per_token
from kvmix.core.tree import combine, map_tensors, tagged_tensors
from kvmix.methods import Blocks, method_classes, parse_method
from kvmix.runtime.cache import model_spec
from kvmix.runtime.inside_vllm import laid_out
from kvmix.runtime.kernels import gpu
from kvmix.vllm import plan
from kvmix.vllm.layer import LayerCache, readers, staging_nbytes, token_values_unserved
from kvmix.vllm.pages import page_layout
from kvmix.vllm.plan import Planner, Readers, StagingLost
from kvmix.vllm.settings import Refused, Settings

G, BLOCK, LAYER, BLOCKS = 8, 16, 1, 12
LAYERS = TINY["num_hidden_layers"]
# new tokens per step of three sequences (0: not in that step): chunks that end mid-group and
# on a group's end, decodes that seal, a chunk that carries staged tokens across two groups
SCHEDULE = [[11, 3, 0], [6, 1, 5], [1, 1, 16], [1, 1, 1], [1, 1, 1], [1, 1, 0], [5, 0, 1],
            [1, 0, 0]]
SEQUENCES = len(SCHEDULE[0])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # Triton compiled, else interpreted
METHODS = ["full", "kivi2", "kxvy:key_bits=4/2,value_bits=2/4", "kxvy:rotate=keys",
           "pnmix1", "kitty", "chanmix", "wush", "ggml-k8v4"]


def settings_for(name: str, staging: torch.dtype = torch.float32, kernels: str = "auto",
                 prefill: str = "decode", values: str = "group") -> Settings:
    per_token = name.startswith("ggml")
    text = name if per_token else method_string(name, sink=0, residual=G, group=G)
    method = laid_out(parse_method(text), text)
    config = LlamaConfig(**TINY)
    fold = method.value_fold(model_spec(config))
    spec = model_spec(config, PAIRS, None, fold[1] if fold else None)
    method.bind(spec)
    return Settings(method, staging, text, spec, torch.float32, kernels, prefill, values)


class Run:
    """Random queries, keys, values of each sequence, fed to a ``LayerCache`` step by step."""

    def __init__(self, settings: Settings, seed: int = 0, schedule=SCHEDULE,
                 device: str = "cpu", by_request: bool = False):
        self.settings, self.method, self.schedule = settings, settings.method, schedule
        self.by_request = by_request  # staging slots are vLLM's request slots (V2's req_idx)
        self.device = torch.device(device)
        lengths = np.array(schedule).sum(0)
        g = torch.Generator().manual_seed(seed)
        self.q = [torch.randn(n, HQ, D, generator=g) for n in lengths]  # [T, Hq, D]
        self.k = [torch.randn(n, H, D, generator=g) * 3 + 1 for n in lengths]
        self.v = [torch.randn(n, H, D, generator=g) for n in lengths]
        order = torch.randperm(BLOCKS, generator=g).numpy()  # blocks handed out of order
        need = -(-lengths // BLOCK)
        self.table = np.zeros((SEQUENCES, need.max()), dtype=np.int64)
        taken = 0
        for s, n in enumerate(need):
            self.table[s, :n] = order[taken : taken + n]
            taken += n
        self.cache = LayerCache(settings, LAYER, torch.float32, SEQUENCES, BLOCK, self.device)
        page = max(page_layout(self.method, settings.spec, layer, torch.float32).page_bytes
                   for layer in range(settings.spec.n_layers))
        self.cache.bind(torch.zeros(BLOCKS, BLOCK // self.method.group * page,
                                    dtype=torch.uint8, device=self.device))
        self.planner = Planner(readers(settings, BLOCK, self.device), SEQUENCES, self.device)
        self.outputs = [torch.zeros(n, HQ, D) for n in lengths]  # each token's attention

    def run(self) -> Run:
        done = np.zeros(SEQUENCES, dtype=np.int64)
        for step in self.schedule:
            rows = [s for s in range(SEQUENCES) if step[s]]
            new = np.array([step[s] for s in rows])
            starts = np.concatenate([[0], np.cumsum(new)])
            lengths = done[rows] + new
            plan = self.planner.plan(starts, lengths, self.table[rows],
                                     np.array(rows) if self.by_request else None)
            spans = [slice(done[s], done[s] + step[s]) for s in rows]
            query, key, value = (torch.cat([x[s][span] for s, span in zip(rows, spans,
                                                                            strict=True)])
                                 for x in (self.q, self.k, self.v))
            query, key, value = (x.to(self.device) for x in (query, key, value))
            output = torch.zeros_like(query)
            self.cache.step(plan, query, key, value, D**-0.5, output)
            for i, (s, span) in enumerate(zip(rows, spans, strict=True)):
                self.outputs[s][span] = output[starts[i] : starts[i + 1]].cpu()
            done[rows] = lengths
        return self

    # -- what kvmix's methods give on the same tokens --------------------------------------

    def expected(self, s: int) -> tuple[list[Blocks], object]:
        """Sequence ``s``'s groups encoded by the method, and its selection."""
        method, G = self.method, self.method.group
        keys = method.transform_keys(self.k[s].transpose(0, 1).unsqueeze(0), LAYER)
        values = self.v[s].transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        queries = method.transform_queries(self.q[s].transpose(0, 1).unsqueeze(0), LAYER)
        first = slice(0, G)
        selection = method.select(queries[:, :, first], keys[:, :, first], LAYER,
                                  values[:, :, first])
        groups = [Blocks(*method.encode(keys[:, :, g * G : (g + 1) * G],
                                        values[:, :, g * G : (g + 1) * G], LAYER, selection))
                  for g in range(keys.shape[2] // G)]
        return groups, selection

    def stored(self, s: int, g: int) -> tuple[Blocks, object]:
        """What page ``g`` of sequence ``s`` holds: its state and its selection ([1, ...])."""
        tokens = g * self.method.group
        page = self.table[s, tokens // BLOCK] * (BLOCK // self.method.group) + \
            tokens % BLOCK // self.method.group
        pages = self.cache.pages
        return (map_tensors(pages.blocks, lambda t: t[page : page + 1]),
                map_tensors(pages.selection, lambda t: t[page : page + 1]))

    def attention(self, s: int, t: int, groups: list[Blocks], selection) -> torch.Tensor:
        """Token ``t``'s output: the groups before its own decoded, then its own group's exact
        floats (whatever step it came in) — its values quantized token by token with
        ``values="token"``."""
        method, G = self.method, self.method.group
        sealed = t // G
        keys = method.transform_keys(self.k[s][: t + 1].transpose(0, 1).unsqueeze(0), LAYER)
        values = self.v[s][: t + 1].transpose(0, 1).unsqueeze(0)  # [1, H, t+1, D]
        if not self.settings.staged_values:
            values = dequantize_per_token(method.token_values(values, LAYER), torch.float32)
        if sealed:
            stacked = combine(groups[:sealed], lambda ts: torch.stack(ts, 1))
            old = method.decode(stacked, LAYER, selection, torch.float32)  # [1, n, H, G, D]
            old = [x.transpose(1, 2).flatten(2, 3) for x in old]
            keys = torch.cat([old[0], keys[:, :, sealed * G :]], 2)
            values = torch.cat([old[1], values[:, :, sealed * G :]], 2)
        query = method.transform_queries(self.q[s][t].view(1, HQ, 1, D), LAYER)
        keys, values = (x.repeat_interleave(HQ // H, 1) for x in (keys, values))
        weights = torch.softmax(query @ keys.transpose(-1, -2) * D**-0.5, -1)
        return (weights @ values)[0, :, 0]  # [Hq, D]


def same(a, b) -> bool:
    left, right = tagged_tensors(a, ""), tagged_tensors(b, "")
    return len(left) == len(right) and all(
        x.shape == y.shape and torch.equal(x, y.to(x.dtype)) for (_, x), (_, y) in
        zip(left, right, strict=True))


def check(run: Run) -> None:
    """Every sealed page holds the method's codes and selection; every output is attention
    over them and the exact float tail."""
    for s in (s for s in range(SEQUENCES) if len(run.q[s])):
        groups, selection = run.expected(s)
        for g, group in enumerate(groups):
            state, chosen = run.stored(s, g)
            assert same(state, group), f"{run.method.name}: sequence {s}, group {g}"
            if selection is not None:
                assert same(chosen, selection), f"{run.method.name}: selection of sequence {s}"
        expected = torch.stack([run.attention(s, t, groups, selection)
                                for t in range(len(run.q[s]))])
        assert_near(run.outputs[s], expected, op_tolerance(run.method) * 10)


@pytest.mark.parametrize("name", METHODS)
def test_pages_hold_the_methods_codes_and_outputs_are_attention_over_them(name):
    check(Run(settings_for(name)).run())


@pytest.mark.parametrize("values", ["group", "token"])
@pytest.mark.parametrize("name", ["kivi2", "pnmix1", "chanmix"])
def test_a_layers_step_is_one_call_of_the_cpu_op_with_its_seals_in_it(monkeypatch, name,
                                                                      values):
    """With the CPU op, a layer's step is one ``kvmix::step`` call (``put_values`` before it
    with values="token"): the groups it seals copy their row's selection, are gathered and are
    encoded into their pages inside it, where the method has a page encoding and no row's
    first group is sealed (its selection is chosen from the group's tokens first); the pages
    are the method's ``encode`` and selection still."""
    from kvmix.runtime.kernels import cpu

    calls, call = [], cpu.call
    monkeypatch.setattr(cpu, "call", lambda op, *a, **k: calls.append(op) or call(op, *a, **k))
    run = Run(settings_for(name, values=values))
    planned = []
    plan_of = run.planner.plan
    run.planner.plan = lambda *a: planned.append(plan_of(*a)) or planned[-1]
    steps = []
    step = run.cache.step
    run.cache.step = lambda *a: (calls.clear(), step(*a), steps.append(list(calls)))
    check(run.run())
    token = ["put_values"] if values == "token" else []
    encoded, selects = run.cache.encoding is not None, run.cache.pages.selection is not None
    assert encoded == (name != "chanmix")
    by_op = 0
    for made, ops in zip(planned, steps, strict=True):
        seals = made.seals
        if seals is not None and (not encoded or (selects and seals.selects)):  # sealed first
            assert ops[-1] == "step" and "seal_tokens" in ops, (name, ops)
            continue
        assert ops == [*token, "step"], (name, ops)
        by_op += seals is not None
    assert by_op or not encoded, "no step sealed its groups inside the op"


@pytest.mark.parametrize("name", ["kivi2", "pnmix1"])
def test_staging_by_request_slot_gives_the_same_pages_and_outputs(name):
    """Model Runner V2 names each row's request slot: the staging slot is that, nothing kept."""
    by_request = Run(settings_for(name), by_request=True).run()
    check(by_request)
    assert by_request.planner.book.page_of.tolist() == [-1] * SEQUENCES  # no book kept


def test_requests_skipped_by_the_scheduler_keep_their_staging_by_request_slot():
    """Every slot holding an open group, requests left out of steps (vLLM's token budget spent)
    while another seals and opens groups: each comes back to its own staged tokens."""
    skipped = [[5, 3, 6], [0, 1, 0], [0, 0, 16], [0, 0, 3], [1, 1, 1], [1, 0, 0]]
    check(Run(settings_for("kivi2"), schedule=skipped, by_request=True).run())


@pytest.mark.parametrize("tokens", [G, 2 * G + 1])
@pytest.mark.parametrize("name", ["kivi2", "pnmix1"])
def test_a_chunks_queries_in_blocks_attend_as_the_whole_chunk_does(monkeypatch, name, tokens):
    """Blocks of one group and of two (a chunk of 11, 16 or 6 tokens then spans several, one
    of them carrying staged tokens): each block's queries see what they saw as one call."""
    monkeypatch.setattr(plan, "QUERY_TOKENS", tokens)
    blocked = Run(settings_for(name, kernels="torch")).run()  # chunks in blocks
    assert len(plan.query_blocks(11, 6, G, torch.device("cpu"))) == 2  # positions 11..16
    check(blocked)


def test_pages_reused_by_new_sequences_decode_with_their_new_selections():
    """vLLM hands freed blocks to new requests: the same pages, new tokens, new selections
    (the fused op's view of the pool must not keep the old ones)."""
    first = Run(settings_for("pnmix1")).run()
    # sequence 0 again, in the same pages: its first decode reads the rows the first run's last
    # decode read
    second = Run(settings_for("pnmix1"), seed=1, schedule=[[16, 0, 0], [1, 0, 0]])
    second.cache, second.table = first.cache, first.table
    check(second.run())


@pytest.mark.parametrize("name", ["kivi2", "pnmix1"])
def test_the_fused_op_and_the_reference_path_agree(name):
    fused = Run(settings_for(name)).run()
    assert fused.cache.kernels == "cpu", "the CPU op is not built here"
    reference = Run(settings_for(name, kernels="torch")).run()
    assert reference.cache.kernels == "torch"
    for a, b in zip(fused.outputs, reference.outputs, strict=True):
        assert_near(a, b, op_tolerance(fused.method))


@pytest.mark.parametrize("name", ["kivi2", "pnmix1"])
def test_a_token_attends_the_same_decoded_or_recomputed_in_a_prefill_chunk(name):
    """With the fused kernels a prefill chunk's tokens are kernel rows, as decodes are: tokens
    first decoded one by one, then recomputed in one chunk (vLLM's preemption), give the same
    outputs to float32 reassociation, even where the kernels round differently from the
    reference path (the CPU op's integer dot products)."""
    decoded = Run(settings_for(name), schedule=[[11, 0, 0]] + [[1, 0, 0]] * 9).run()
    recomputed = Run(settings_for(name), schedule=[[20, 0, 0]]).run()
    assert recomputed.cache.kernels == "cpu"
    assert_near(recomputed.outputs[0], decoded.outputs[0], 1e-5)


@pytest.mark.skipif(not gpu.available()[0], reason="Triton is not installed")
@pytest.mark.parametrize("name", ["full", "kivi2", "pnmix1", "chanmix", "wush"])
def test_the_triton_kernels_read_vllms_pages_as_the_reference_path_does(name):
    """Decode rows through kvmix's Triton kernels over vLLM's block table (compiled on a CUDA
    device, else in Triton's interpreter), prefill chunks beside them: per-token, per-channel
    (one, two and four planes) and float pages, the same outputs as the reference path on the
    CPU, pages out of order."""
    fused = Run(settings_for(name, kernels="triton"), device=DEVICE).run()
    assert fused.cache.kernels == "triton"
    reference = Run(settings_for(name, kernels="torch")).run()
    for a, b in zip(fused.outputs, reference.outputs, strict=True):
        assert_near(a, b, op_tolerance(fused.method, gpu))


@pytest.mark.skipif(not gpu.available()[0], reason="Triton is not installed")
def test_triton_splits_of_a_rows_pages_merge_to_the_reference_path(monkeypatch):
    """Many programs per row and KV head, as on a GPU: a row's pages in vLLM's block table
    split between them, the splits merged by log-sum-exp."""
    monkeypatch.setattr(gpu, "PROGRAMS", 64)
    fused = Run(settings_for("kivi2", kernels="triton"), device=DEVICE).run()
    reference = Run(settings_for("kivi2", kernels="torch")).run()
    for a, b in zip(fused.outputs, reference.outputs, strict=True):
        assert_near(a, b, op_tolerance(fused.method, gpu))


@pytest.mark.parametrize("name, values", [("kivi2", "group"), ("kxvy:rotate=keys", "group"),
                                          ("kivi2", "token")])
def test_an_exact_prefill_attends_a_prompts_first_chunk_in_float(name, values):
    """prefill="exact": each prompt's first chunk is a float prefill (causal attention over its
    own tokens, in the method's key frame), every later token attends as it does by default,
    and the pages hold the same codes (with values="token", those of a step of float prefills
    alone put by the layer, not the op)."""
    exact, decodes = (Run(settings_for(name, prefill=p, values=values)).run()
                      for p in ("exact", "decode"))
    method, differs = exact.method, False
    for s in range(SEQUENCES):
        n = next(step[s] for step in SCHEDULE if step[s])  # the first chunk's tokens
        keys = method.transform_keys(exact.k[s][:n].transpose(0, 1).unsqueeze(0), LAYER)
        query = method.transform_queries(exact.q[s][:n].transpose(0, 1).unsqueeze(0), LAYER)
        keys, values = (x.repeat_interleave(HQ // H, 1) for x in
                        (keys, exact.v[s][:n].transpose(0, 1).unsqueeze(0)))
        scores = (query @ keys.transpose(-1, -2) * D**-0.5).masked_fill(
            ~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        prefill = (torch.softmax(scores, -1) @ values)[0].transpose(0, 1)  # [n, Hq, D]
        assert_near(exact.outputs[s][:n], prefill, 1e-5)
        assert torch.equal(exact.outputs[s][n:], decodes.outputs[s][n:])
        differs |= not torch.equal(exact.outputs[s][:n], decodes.outputs[s][:n])
    assert differs  # a first chunk past one group: its later tokens saw packed groups before
    assert same(exact.cache.pages, decodes.cache.pages)


def test_an_exact_prefill_selects_from_its_whole_first_chunk():
    """PN-Mix with prefill="exact": a first chunk longer than a group selects from all of its
    tokens (as kvmix's own cache selects at a prompt), and every page of the sequence holds
    that selection; a first chunk within a group selects as by default."""
    exact, decodes = (Run(settings_for("pnmix1", prefill=p)).run() for p in ("exact", "decode"))
    method, G = exact.method, exact.method.group
    for s in range(SEQUENCES):
        n = next(step[s] for step in SCHEDULE if step[s])
        keys = method.transform_keys(exact.k[s][:n].transpose(0, 1).unsqueeze(0), LAYER)
        queries = method.transform_queries(exact.q[s][:n].transpose(0, 1).unsqueeze(0), LAYER)
        prompt = method.select(queries, keys, LAYER, exact.v[s][:n].transpose(0, 1).unsqueeze(0))
        expected = prompt if n > G else decodes.stored(s, 0)[1]
        for g in range(len(exact.k[s]) // G):
            assert same(exact.stored(s, g)[1], expected), f"sequence {s}, page {g}"
    assert not same(exact.stored(0, 0)[1], decodes.stored(0, 0)[1])  # 11 tokens, not 8


@pytest.mark.parametrize("staging, tolerance", [(torch.float16, 0.0), (torch.bfloat16, 0.0)])
def test_a_staging_keeps_what_its_dtype_holds(staging, tolerance):
    """Staged tokens are rounded to the staging dtype and nothing else changes: on keys and
    values the dtype holds exactly, it gives float32 staging's pages and outputs — exactly for
    float16 and bfloat16, which the CPU op reads in place (widened as it reads them)."""
    runs = []
    for dtype in (staging, torch.float32):
        run = Run(settings_for("kivi2", dtype))
        run.k, run.v = ([x.to(staging).float() for x in xs] for xs in (run.k, run.v))
        runs.append(run.run())
    rounded, exact = runs
    assert rounded.cache.staging.dtype == staging and rounded.cache.kernels == "cpu"
    for a, b in zip(rounded.outputs, exact.outputs, strict=True):
        assert_near(a, b, tolerance)
    assert same(rounded.cache.pages, exact.cache.pages)


@pytest.mark.parametrize("name, staging", [("pnmix1", torch.float16), ("kivi2", torch.float32)])
def test_staging_is_one_group_per_slot_as_the_startup_line_says(name, staging):
    settings = settings_for(name, staging)
    layers = [LayerCache(settings, layer, torch.float32, 5, BLOCK, torch.device("cpu"))
              for layer in range(settings.spec.n_layers)]
    floats = 2 * 5 * H * G * D * staging.itemsize  # keys and values, 5 slots
    assert layers[0].staging_bytes() >= floats
    assert sum(cache.staging_bytes() for cache in layers) == staging_nbytes(settings, 5)


@pytest.mark.parametrize("name, staging", [
    ("kivi2", torch.float32), ("kxvy:key_bits=4/2,value_bits=2/4", torch.float32),
    ("pnmix1", torch.float16), ("chanmix", torch.float32), ("kivi2", torch.bfloat16)])
def test_values_by_token_fill_the_methods_pages_and_own_groups_attend_quantized_values(name,
                                                                                     staging):
    """values="token": every page still holds the method's encode of its group, bit for bit
    (values written token by token as they came, keys at the seal), and each token attends to
    its own group's keys as floats and its values as the page holds them (on keys and values
    the staging dtype holds exactly)."""
    run = Run(settings_for(name, staging, values="token"))
    run.k, run.v = ([x.to(staging).float() for x in xs] for xs in (run.k, run.v))
    run.run()
    assert run.cache.staging.values is None and run.cache.kernels == "cpu"
    check(run)
    by_request = Run(settings_for(name, staging, values="token"), by_request=True)
    by_request.k, by_request.v = run.k, run.v
    by_request.run()
    for a, b in zip(by_request.outputs, run.outputs, strict=True):
        assert_near(a, b, 1e-5)


def test_values_by_token_change_only_the_own_groups_values():
    """Against the default (values staged as floats), the outputs differ — the own group's
    values are quantized — and the sealed pages do not."""
    token = Run(settings_for("kivi2", values="token")).run()
    group = Run(settings_for("kivi2")).run()
    for s, n in enumerate(np.array(SCHEDULE).sum(0)):
        for g in range(n // G):
            assert same(token.stored(s, g), group.stored(s, g))
    assert max((a - b).abs().max() for a, b in zip(token.outputs, group.outputs,
                                                    strict=True)) > 1e-3


@pytest.mark.parametrize("name, staging", [("pnmix1", torch.float16), ("kivi2", torch.float32)])
def test_values_by_token_stage_keys_only(name, staging):
    group, token = (settings_for(name, staging, values=v) for v in ("group", "token"))
    sums = staging_nbytes(group, 5) - 2 * 5 * H * G * D * staging.itemsize * LAYERS
    assert staging_nbytes(token, 5) == 5 * H * G * D * staging.itemsize * LAYERS + sums
    cache = LayerCache(token, LAYER, torch.float32, 5, BLOCK, torch.device("cpu"))
    assert cache.staging_bytes() * LAYERS == staging_nbytes(token, 5)


@pytest.mark.parametrize("kernels, staging, match", [("torch", torch.float32, "kernels: torch")])
def test_values_by_token_where_the_cpu_op_cannot_read_them_are_refused(kernels, staging, match):
    settings = settings_for("kivi2", staging, kernels, values="token")
    assert match in token_values_unserved(settings, torch.device("cpu"))
    assert token_values_unserved(settings_for("kivi2", values="token"), torch.device("cpu")) == ""
    with pytest.raises(Refused, match=match):  # nor does a layer cache take them
        LayerCache(settings, LAYER, torch.float32, SEQUENCES, BLOCK, torch.device("cpu"))


def test_values_by_token_in_groups_the_ops_encoder_does_not_take_are_refused():
    """The op quantizes a token's values in groups of a power of two from 8 to 256 channels."""
    text = method_string("kivi2", sink=0, residual=G, group=G, value_group=24)
    method = laid_out(parse_method(text), text)
    spec = model_spec(LlamaConfig(**{**TINY, "head_dim": 48}), None)
    method.bind(spec)
    settings = Settings(method, torch.float32, text, spec, torch.float32, values="token")
    assert "value groups of 24 channels" in token_values_unserved(settings, torch.device("cpu"))


@pytest.mark.parametrize("name, transforms", [
    ("kivi2", []), ("kxvy:rotate=keys", ["transform_queries", "transform_keys"]),
    ("wush", ["transform_queries", "transform_keys"]),
    ("ggml-k8v4", ["transform_queries", "transform_keys"]),
    # keys in the model's order and frame; queries still rounded to q8_0 as llama.cpp's
    ("ggml-k8v4:rotate=none,key_order=model", ["transform_queries"])])
def test_a_step_runs_only_the_transforms_that_change_queries_or_keys(name, transforms):
    cache = LayerCache(settings_for(name), LAYER, torch.float32, SEQUENCES, BLOCK,
                       torch.device("cpu"))
    assert cache.transforms == transforms


def test_a_reclaimed_open_group_is_never_read():
    planner = Planner(Readers(G, BLOCK), 2, torch.device("cpu"))
    table = np.arange(3).reshape(3, 1)

    def step(rows, before, new):
        starts = np.concatenate([[0], np.cumsum(new)])
        built = planner.plan(starts, np.array(before) + np.array(new), table[rows])
        built.ran = True  # as a layer running it marks it
        return built

    step([0, 1], [0, 0], [3, 3])  # two open groups: both slots taken
    built = step([2], [0], [3])  # a third: the slot used longest ago is reclaimed
    assert (built.writes.stage_at // G).unique().numel() == 1
    with pytest.raises(StagingLost, match="max_num_seqs"):
        step([0, 1], [3, 3], [1, 1])  # one of the first two lost its staged tokens


@pytest.mark.parametrize("values", ["group", "token"])
def test_a_dummy_batch_on_the_null_block_leaves_staging_and_pages_as_they_were(values):
    """vLLM's warm-up and graph-capture runs (Model Runner V2's dummy batches: every row's
    table on the null block 0, no context, unpadded counts): the builder plans nothing."""
    from types import SimpleNamespace

    from kvmix.vllm.backend import NULL_BLOCK, KvmixMetadataBuilder

    run = Run(settings_for("pnmix1", values=values), schedule=SCHEDULE[:3]).run()
    builder = KvmixMetadataBuilder.__new__(KvmixMetadataBuilder)
    builder.settings, builder.planner = run.settings, run.planner
    builder.idle = plan.idle_plan(run.planner.readers, torch.device("cpu"))
    rows, tokens = 4, 6
    starts = torch.tensor([0, 1, 2, 3, tokens])
    meta = SimpleNamespace(num_reqs=rows, num_actual_tokens=tokens, query_start_loc_cpu=starts,
                           seq_lens=starts.diff(), seq_lens_cpu_upper_bound=starts.diff(),
                           block_table_tensor=torch.full((rows, 8), NULL_BLOCK),
                           req_idx=np.arange(rows))
    staged = [t.clone() for t in run.cache.staging.take(torch.arange(SEQUENCES * G))]
    pages = run.cache.cache.clone()
    book = run.planner.book.page_of.copy(), run.planner.book.used.copy(), run.planner.book.step
    built = builder.build(0, meta).plan
    q = torch.randn(tokens, HQ, D)
    kv = torch.randn(tokens, H, D)
    run.cache.step(built, q, kv, kv, D**-0.5, torch.zeros_like(q))
    assert built.sealed == 0 and built.rows is None and not built.chunks
    assert torch.equal(run.cache.cache, pages)
    for before, after in zip(staged, run.cache.staging.take(torch.arange(SEQUENCES * G)),
                             strict=True):
        assert torch.equal(before, after)
    after = run.planner.book
    assert (after.page_of.tolist(), after.used.tolist(), after.step) == \
        (book[0].tolist(), book[1].tolist(), book[2])


def test_a_full_staging_with_every_slot_in_the_step_is_refused():
    planner = Planner(Readers(G, BLOCK), 1, torch.device("cpu"))
    with pytest.raises(StagingLost, match="raise max_num_seqs"):
        planner.plan(np.array([0, 3, 6]), np.array([3, 3]), np.arange(2).reshape(2, 1))


@pytest.mark.parametrize("text, match", [
    ("kivi2:sink=4", "sink=4"),
    ("kivi2:residual=256", "residual=256"),
    ("polar", "not served"),
])
def test_layouts_vllm_blocks_cannot_hold_are_refused(text, match):
    with pytest.raises(Refused, match=match):
        laid_out(parse_method(text), text)


def test_kernels_follow_the_device_and_a_choice_they_cannot_honour_is_refused(monkeypatch):
    """auto: the CPU op on CPU, Triton on CUDA, the reference path where neither reads the
    cache (with the reason); the CPU op asked for by name on CUDA is refused — by the runtime's
    one choice, which the plugin decides once per engine's settings."""
    from dataclasses import replace

    from kvmix.runtime.kernels import Unserved, choose
    from kvmix.vllm import layer

    settings = settings_for("kivi2")
    method, cpu, cuda = settings.method, torch.device("cpu"), torch.device("cuda")
    assert choose("auto", method, D, torch.float32, cpu) == ("cpu", "")
    assert choose("auto", method, D, torch.float32, cuda) == ("triton", "")
    assert choose("torch", method, D, torch.float32, cuda) == ("torch", "")
    with pytest.raises(Unserved, match="kernels='cpu' cannot be honoured: the cache is on cuda"):
        choose("cpu", method, D, torch.float32, cuda)
    with pytest.raises(Refused, match="the cache is on cuda"):  # the plugin's refusal
        layer.kernel_choice(replace(settings, kernels="cpu"), cuda)
    assert layer.kernel_choice(settings, cpu) == "cpu"
    with monkeypatch.context() as patched:  # Triton on CPU tensors only interpreted
        patched.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(Unserved, match="Triton runs on CUDA tensors"):
            choose("triton", method, D, torch.float32, cpu)
    monkeypatch.setattr(layer.gpu, "available", lambda: (False, "Triton is not installed"))
    assert choose("auto", method, D, torch.float32, cuda) == ("torch", "Triton is not installed")
    with pytest.raises(Unserved, match="Triton is not installed"):
        choose("triton", method, D, torch.float32, cuda)


@pytest.mark.parametrize("name", [*sorted(method_classes()), "pnmix:criterion=qk_pair_norm,"
                                  "selection=online", "kxvy:key_bits=4/2,value_bits=2/4"])
def test_every_method_in_the_registry_runs_inside_vllm_or_is_refused_naming_why(name):
    """Each registered method (and the settings that change its path) either serves a few
    steps — batched chunks, decodes, seals — with finite outputs, or is refused by kvmix
    before any step, naming why."""
    try:
        run = Run(settings_for(name), schedule=SCHEDULE[:4])
    except Refused as refusal:
        assert name.partition(":")[0] in str(refusal) and (
            "not served" in str(refusal) or "cannot select" in str(refusal))
        return
    outputs = torch.cat(run.run().outputs)
    assert outputs.abs().sum() > 0 and torch.isfinite(outputs).all()


def test_a_plan_is_one_upload_of_the_groups_its_readers_run():
    """A step's plan: its index tensors views of one upload of its own (a plan stays valid
    whatever is planned after it), only the groups a reader runs in that step (a decode step
    seals nothing; the CPU op stages its tokens), and the same plan when one step is planned
    twice — the slots assigned then commit only once a layer has run the step."""
    run = Run(settings_for("kivi2"), schedule=SCHEDULE[:2]).run()
    planner = run.planner
    starts, lengths = np.array([0, 1, 2]), np.array([18, 5])  # two decodes, no group complete
    first = planner.plan(starts, lengths, run.table[:2])
    again = planner.plan(starts, lengths, run.table[:2])
    tensors = [t for group in (first.writes, first.rows) for t in vars(group).values()
               if isinstance(t, torch.Tensor) and t.numel()]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1 and len(tensors) >= 5
    assert first.seals is None and first.sums is None and not first.chunks
    assert first.writes.by_op and first.writes.staged is None and first.rows.count == 2
    for a, b in ((first.writes, again.writes), (first.rows, again.rows)):
        assert all(torch.equal(x, y) for x, y in zip(vars(a).values(), vars(b).values(),
                                                     strict=True)
                   if isinstance(x, torch.Tensor))
    assert first.writes.stage_at.data_ptr() != again.writes.stage_at.data_ptr()
    book = planner.book.page_of.copy()
    sealing = planner.plan(starts, np.array([24, 5]), run.table[:2])  # group 2 of row 0
    assert sealing.sealed == 1 and sealing.rows.floats[0, 1] == 7  # 7 staged, then itself
    assert planner.book.page_of.tolist() == book.tolist()  # nothing ran: nothing committed


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("token_values, sums, selects", [(False, False, False),
                                                         (True, True, True)])
def test_the_op_librarys_plan_is_the_reference_plan(exact, token_values, sums, selects):
    """``kvmix::plan_step`` (the CPU op's planner, in one call) gives ``reference_plan``'s
    arrays for random steps: decodes and chunks, groups sealed, carried and opened, rows with
    and without staged tokens, prompts' first chunks (reference-path chunks where ``exact``)."""
    readers = Readers(G, BLOCK, "cpu", exact, token_values, sums, selects)
    rng = np.random.default_rng(0)
    seen = set()
    for step in range(60):
        R = int(rng.integers(0, 7))
        new = np.where(rng.random(R) < 0.5, 1, rng.integers(0, 3 * G, R))  # 0: none this step
        before = np.where(rng.random(R) < 0.3, 0, rng.integers(0, 5 * G, R))
        lengths = before + new
        width = int(-(-lengths.max(initial=1) // BLOCK)) + 1
        # vLLM's block table: int32, its rows as wide as the longest request's (a view)
        wide = rng.permutation(R * (width + 2) + 1)[1:].reshape(R, width + 2)
        table = wide.astype(np.int32 if step % 2 else np.int64)[:, :width]
        rows = plan.Rows(np.concatenate([[0], np.cumsum(new)]).astype(np.int64),
                         lengths.astype(np.int64), table, G, BLOCK)
        slot = rng.permutation(16)[:R].astype(np.int64)
        slots = plan.Slots(np.where(rows.staged > 0, slot, -1),
                           np.where(lengths % G > 0, slot, -1))
        host = plan._host_plan(rows, slots, readers)
        reference = plan.reference_plan(rows, slots, readers, torch.device("cpu"))
        assert (host.tokens, host.sealed) == (reference.tokens, reference.sealed)
        assert [(c.start, c.stop, c.pages, c.slot) for c in host.chunks] == \
            [(c.start, c.stop, c.pages, c.slot) for c in reference.chunks]
        assert bool(host.chunks) == (exact and bool((rows.before == 0)[rows.new != 1].any()))
        assert (host.rows is None) == (reference.rows is None)
        assert (host.rows is None) or host.rows.step_rows is not None
        seen |= {name for name, happened in (
            ("carried", host.seals is not None and host.seals.carried.numel()),
            ("first groups sealed", host.seals is not None and host.seals.selects),
            ("chunks", host.chunks), ("sums", host.sums is not None),
            ("rows", host.rows is not None)) if happened}
        for part in ("writes", "seals", "sums", "rows"):
            a, b = getattr(host, part), getattr(reference, part)
            assert (a is None) == (b is None), part
            for name, x in ({} if a is None else vars(a)).items():
                y = getattr(b, name)
                if name == "step_rows":
                    continue
                if isinstance(x, torch.Tensor):
                    assert y is not None and x.shape == y.shape and torch.equal(x, y), \
                        (part, name, x, y)
                else:
                    assert x == y, (part, name)
    assert seen >= {"carried", "first groups sealed", "rows"} | (
        {"chunks"} if exact else set()) | ({"sums"} if sums else set())


def test_the_op_librarys_slot_book_is_the_page_slots_book(monkeypatch):
    """``kvmix::assign_slots`` (the page-keyed staging book in one call) assigns what
    ``PageSlots.assign`` does for random books and steps: found, opened, given back and
    reclaimed slots, the book after the step, and the same refusal where a running row's open
    group is gone or more groups open than there are slots."""
    rng = np.random.default_rng(1)
    seen = set()
    reclaim = plan.PageSlots._reclaim
    monkeypatch.setattr(plan.PageSlots, "_reclaim",
                        lambda *a: seen.add("reclaimed") or reclaim(*a))
    for trial in range(300):
        slots, R = int(rng.integers(1, 9)), int(rng.integers(0, 7))
        new = np.where(rng.random(R) < 0.6, 1, rng.integers(1, 3 * G, R))
        lengths = rng.integers(0, 5 * G, R) + new
        width = int(-(-lengths.max(initial=1) // BLOCK)) + 1
        table = rng.permutation(R * width + 1)[1:].reshape(R, width).astype(np.int64)
        rows = plan.Rows(np.concatenate([[0], np.cumsum(new)]).astype(np.int64),
                         lengths.astype(np.int64), table, G, BLOCK)
        book = plan.PageSlots(slots)
        opened = rows.page(np.arange(R), rows.opened)  # some rows' open groups are in the book
        held = np.concatenate([opened[rng.random(R) < 0.7], rng.integers(0, 99, slots)])
        book.page_of = np.where(rng.random(slots) < 0.8, held[:slots], -1)
        if len(set(book.page_of[book.page_of >= 0].tolist())) < (book.page_of >= 0).sum():
            continue  # a page's open group is in one slot only
        book.used, book.step = rng.integers(0, 9, slots), int(rng.integers(0, 9))
        results = []
        for assign in (book.assign, book.assign_by_op):
            try:
                results.append(assign(rows))
            except plan.StagingLost as error:
                results.append(str(error))
        numpy, op = results
        if isinstance(numpy, str):
            seen.add("refused")
            assert op == numpy
            continue
        seen.add("assigned")
        for a, b in ((numpy.before, op.before), (numpy.after, op.after),
                     (numpy.book.page_of, op.book.page_of), (numpy.book.used, op.book.used)):
            assert a.tolist() == b.tolist(), trial
        assert numpy.book.step == op.book.step
    assert seen >= {"refused", "assigned", "reclaimed"}


def test_micro_batching_is_refused_by_name():
    """vLLM's micro-batches (--enable-dbo, --ubatch-size) would plan two batches before either
    runs: kvmix plans one batch a step and refuses them at start-up."""
    from types import SimpleNamespace

    from kvmix.vllm.backend import refuse

    settings = settings_for("kivi2")
    config = SimpleNamespace(
        speculative_config=None, kv_transfer_config=None,
        parallel_config=SimpleNamespace(use_ubatching=True),
        cache_config=SimpleNamespace(enable_prefix_caching=False, block_size=BLOCK,
                                     enable_extensible_kv_cache=False))
    layer = {"head_size": D, "num_heads": HQ, "num_kv_heads": H, "sliding_window": None,
             "kv_cache_dtype": "auto", "logits_soft_cap": None, "alibi_slopes": None,
             "attn_type": "decoder", "kv_sharing_target_layer_name": None, "sinks": None}
    with pytest.raises(Refused, match="micro-batching"):
        refuse(config, settings, **layer)
    config.parallel_config.use_ubatching = False
    refuse(config, settings, **layer)
