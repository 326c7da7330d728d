"""Shared fixtures: a tiny random Llama (GQA, 2 layers), the same with the default model's
tokenizer for the serving tests (in memory or saved as a model folder) and a server over it on
the loopback address, a folder for every file Ray writes, and, once per session, the real
model."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import tempfile
import time

# Every temporary file of a test process and of the processes it starts (pytest's tmp_path,
# torch's compile caches that vLLM's sampler fills, vLLM's sockets) in a folder of its own,
# removed at its exit: nothing left in /tmp. Set before anything asks for the temp folder.
# Short: Ray's socket paths under it must stay short.
os.environ["TMPDIR"] = tempfile.tempdir = tempfile.mkdtemp(prefix="kt")

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; it is chosen when the
# kernels are defined, so before kvmix is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import LlamaConfig, LlamaForCausalLM

atexit.register(shutil.rmtree, tempfile.tempdir, True)  # the temporary folder above

# Under pytest-xdist (make test: one worker per core) each worker computes on one thread: more
# threads than cores slow every worker down.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    """The real model's tests first, as one module (its fixtures stay set up once): they are
    the longest, and under xdist the tests that start last set the end of the run (a long one
    there leaves the other worker idle)."""
    items.sort(key=lambda item: item.path.name != "test_integration.py")  # stable


TINY = {"vocab_size": 97, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 512, "pad_token_id": 0}


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides})).eval()


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    return tiny_llama()


def served_llama(tokenizer) -> LlamaForCausalLM:
    """The tiny Llama with the vocabulary and end of sequence of ``tokenizer``."""
    return tiny_llama(vocab_size=len(tokenizer), max_position_embeddings=1024,
                      eos_token_id=tokenizer.eos_token_id, pad_token_id=None)


@contextlib.contextmanager
def saved_model(tokenizer):
    """``served_llama`` and its tokenizer saved as a model folder, removed afterwards."""
    folder = tempfile.mkdtemp(prefix="kvmix-model-")
    served_llama(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def ray_files():
    """Every file Ray writes (sessions, sockets, the address of the current cluster) in a
    folder of its own, removed afterwards (short: Ray's socket paths must stay short)."""
    temp = tempfile.mkdtemp(prefix="ray")
    before = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = temp
    try:
        yield temp
    finally:
        if before is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = before
        shutil.rmtree(temp, ignore_errors=True)


# Served requests are checked token for token against solo runs. The model's float32 differs by
# an ulp between forwards of different shapes (a 20-token and an 11-token forward: 1.2e-7 in
# the logits), and float16 slots can round such a key to the neighbouring float16 value, which
# turns near-ties of a random model into other tokens; so the servers' tests keep float32 slots.
# The float16 default is served token for token in test_paged (and in the cache contract).
SERVED_METHOD = "kivi2:sink=4,residual=16,group=8,residual_dtype=float32"
SERVED_NEW = 24


@contextlib.contextmanager
def slowed(manager, seconds: float = 0.02):
    """Every forward of ``manager``'s model takes ``seconds`` longer inside the block: a request
    of many tokens then runs for seconds, so a test acts on it while it runs, however loaded
    the machine (a tiny model otherwise finishes 150 tokens within one poll of the server)."""
    model, forward = manager.model, manager.model.forward

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return forward(*args, **kwargs)

    model.forward = slow
    try:
        yield
    finally:
        del model.forward


@contextlib.contextmanager
def serving(model, tokenizer, limits=None, requests: float = 4):
    """(manager, server) of ``kvmix serve`` on 127.0.0.1, a free port (``SERVED_METHOD``,
    ``SERVED_NEW`` tokens a request by default): a budget of ``requests`` requests of 200 tokens
    at once; stopped after the block."""
    from kvmix.serving.paged import KVMixManager
    from kvmix.serving.server import Limits, Server, build_app

    budget = KVMixManager(model, SERVED_METHOD, 1e9).budget
    memory = requests * budget.footprint(200) + budget.static
    manager = KVMixManager(model, SERVED_METHOD, memory, max_new_tokens=SERVED_NEW, length=200)
    limits = limits or Limits(max_tokens=SERVED_NEW)
    server = Server(build_app(manager, tokenizer, "tiny", limits), "127.0.0.1", 0)
    manager.start()
    server.start()
    try:
        yield manager, server
    finally:
        server.stop()
        manager.stop(block=True)


def idle(manager, timeout: float = 60.0) -> None:
    """Wait until nothing runs, then check that nothing of a finished request stays."""
    deadline = time.monotonic() + timeout
    while manager.stats.snapshot()["running"] or manager.cache.rows or \
            manager.input_queue.qsize() or manager.stats.snapshot()["waiting"]:
        assert time.monotonic() < deadline, "requests still running"
        time.sleep(0.05)
    time.sleep(0.1)  # a cancellation is applied at the loop's next turn
    for layer in manager.cache.layers:
        assert layer.store.batch == 0 and layer.pool.used == 0
    assert not manager.cache.reserved and manager.cache.rows_reserved == 0


def run_requests(manager, requests: list[dict], timeout: float = 120) -> dict:
    """Each request (``add_request``'s arguments) through a started manager -> every choice's
    output by request id."""
    manager.start()
    try:
        expected = sum(r.get("n", 1) for r in requests)
        for r in requests:
            manager.add_request(**r)
        results, deadline = {}, time.monotonic() + timeout
        while len(results) < expected:
            assert time.monotonic() < deadline, f"only {len(results)} of {expected} finished"
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
    finally:
        manager.stop(block=True)
    return results


@pytest.fixture(scope="session")
def real_model():
    from kvmix.models.loading import load_model

    return load_model()
