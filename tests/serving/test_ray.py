"""``kvmix serve`` replicas on Ray Serve, with real Ray on this machine: a simulated two-node
cluster (``ray.cluster_utils.Cluster``, one replica per node) started once for the module and
shut down after it, every file it wrote removed. The replicas serve a tiny random model saved to
a folder, as a user's model folder."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from dataclasses import replace
from types import SimpleNamespace

import httpx
import pytest
import torch

pytest.importorskip("ray.serve", reason="the ray extra is not installed")
os.environ["RAY_AUTH_MODE"] = "disabled"

import ray
from conftest import SERVED_METHOD, ray_files, saved_model
from ray import serve
from ray.cluster_utils import Cluster
from transformers import LlamaForCausalLM

import kvmix
from kvmix.models.loading import load_tokenizer
from kvmix.serving.launch import Scale, ServeConfig, deploy_config
from kvmix.serving.replicas import FreePagesRouter, KVUsagePolicy, application

# A local Ray cluster: not in make check; under xdist on the worker of the other Ray module
# (one cluster at a time on this machine).
pytestmark = [pytest.mark.process, pytest.mark.xdist_group("ray")]
METHOD = SERVED_METHOD  # the budgets below are sized for its float32 slots
TIMEOUT = 60.0
KEY = "ray-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "Water boils at", "1, 2, 3, 4,", "Dear Sir or Madam,"]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2")


@pytest.fixture(scope="module")
def model_folder(tokenizer):
    with saved_model(tokenizer) as folder:
        yield folder


@pytest.fixture(scope="module")
def cluster():
    """Two raylets on this machine (2 CPUs each), the driver connected; gone afterwards."""
    with ray_files():
        two = Cluster(initialize_head=True, connect=True, shutdown_at_exit=False,
                      head_node_args={"num_cpus": 2, "include_dashboard": False})
        two.add_node(num_cpus=2)
        two.wait_for_nodes()
        try:
            yield two
        finally:
            serve.shutdown()
            ray.shutdown()
            two.shutdown()


@pytest.fixture(scope="module")
def served(cluster, model_folder):
    """(url, config): two replicas, one per node, each a budget of four requests of 88 tokens
    (150 KB: one request of 800 tokens leaves less than one of 88 needs)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = ServeConfig(model=model_folder, method=METHOD, memory="150KB", fit_prompt=64,
                         max_tokens=24, port=port)
    # the key only in the driver's environment, while the app is bound: the nodes' raylets,
    # started before, never had it
    os.environ["KVMIX_API_KEY"] = KEY
    try:
        app = application(config, Scale(replicas=2, cpus=0.5, per_node=1))
    finally:
        del os.environ["KVMIX_API_KEY"]
    serve.run(app, name="kvmix", route_prefix="/")
    yield f"http://127.0.0.1:{port}", config


def replicas() -> list:
    """The live replica actors (handles whose routing stats can be read) and their nodes; one
    still starting (busy building its model) is not live yet."""
    found = []
    for named in ray.util.list_named_actors(all_namespaces=True):
        if named["name"].startswith("SERVE_REPLICA::kvmix#kvmix#"):
            with contextlib.suppress(ValueError, ray.exceptions.RayActorError,
                                     ray.exceptions.GetTimeoutError):
                actor = ray.get_actor(named["name"], namespace=named["namespace"])
                node = ray.get(actor.__ray_call__.remote(
                    lambda _: ray.get_runtime_context().get_node_id()), timeout=10)
                found.append(SimpleNamespace(node=node, actor=actor))
    return found


def stats(replica) -> dict:
    return ray.get(replica.actor.record_routing_stats.remote(), timeout=30)


def alone(folder: str, tokenizer, prompt: str, new: int = 24) -> str:
    model = LlamaForCausalLM.from_pretrained(folder).eval()
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, cache=kvmix.make_cache(model, METHOD), max_new_tokens=new,
                             do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


def test_one_replica_per_node_and_greedy_outputs_as_alone(served, model_folder, tokenizer):
    """The simulated two-node cluster holds one replica on each node; six requests at once
    through Serve's proxy each get what generate gives the prompt alone."""
    url, _ = served
    assert len({r.node for r in replicas()}) == 2

    async def send_all():
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=AUTH) as http:
            return await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": p, "max_tokens": 24}) for p in PROMPTS))

    answers = asyncio.run(send_all())
    assert [a.status_code for a in answers] == [200] * len(PROMPTS)
    assert [a.json()["choices"][0]["text"] for a in answers] == \
        [alone(model_folder, tokenizer, p) for p in PROMPTS]


def test_the_key_guards_every_replica_on_every_node(served):
    """The key was in the driver's environment only, never in the nodes' (their raylets
    started before it was set): the replicas refuse requests without it (401) and /docs, and
    serve them with it."""
    url, _ = served

    async def send(headers: dict) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=headers) as http:
            answers = await asyncio.gather(*(http.post("/v1/completions", json={
                "prompt": p, "max_tokens": 2}) for p in PROMPTS))
            return [a.status_code for a in answers]

    assert asyncio.run(send({})) == [401] * len(PROMPTS)
    assert asyncio.run(send({"Authorization": "Bearer wrong"})) == [401] * len(PROMPTS)
    assert asyncio.run(send(AUTH)) == [200] * len(PROMPTS)
    with httpx.Client(base_url=url, timeout=TIMEOUT) as http:
        assert http.get("/docs").status_code == 404


def test_requests_go_where_their_pages_fit_and_wait_when_none_has_room(served):
    """A long request reserves most of one replica's bytes (its room drops to 0 while it
    holds one request): the next requests go to the other replica; with no room left
    anywhere, one more waits and is answered, not refused."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as http, \
            http.stream("POST", "/v1/completions", json={
                "prompt": "a b c", "max_tokens": 800, "ignore_eos": True,
                "stream": True}) as long:
        lines = long.iter_lines()  # one iterator: closing one closes the stream
        next(line for line in lines if line.startswith("data: "))
        time.sleep(1.5)  # the replicas report again (every second)
        full, free = sorted(replicas(), key=lambda r: stats(r)["room"])
        assert stats(full)["room"] == 0 and stats(free)["room"] >= 2
        before = stats(full)["started"]

        async def two():
            async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, headers=AUTH) as a:
                return await asyncio.gather(*(a.post("/v1/completions", json={
                    "prompt": p, "max_tokens": 24, "ignore_eos": True}) for p in PROMPTS[:2]))

        assert [r.status_code for r in asyncio.run(two())] == [200, 200]
        assert stats(full)["started"] == before  # both went to the replica with room
        with http.stream("POST", "/v1/completions", json={
                "prompt": "d e f", "max_tokens": 800, "ignore_eos": True,
                "stream": True}) as other:
            more = other.iter_lines()
            next(line for line in more if line.startswith("data: "))
            assert [stats(r)["room"] for r in replicas()] == [0, 0]
            waited = http.post("/v1/completions", json={"prompt": "g", "max_tokens": 4})
            assert waited.status_code == 200  # it waited for pages, it was not refused
            assert [line for line in more if line.startswith("data: ")][-1] == "data: [DONE]"
        rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"


def test_a_killed_replica_fails_its_requests_and_serve_restarts_it(served):
    """ray.kill of the replica holding a stream: the stream ends (an error, never a hang), a
    new request is served by the other replica, and Serve brings the deployment back to two."""
    url, _ = served
    with httpx.Client(base_url=url, timeout=TIMEOUT, headers=AUTH) as http:
        with http.stream("POST", "/v1/completions", json={
                "prompt": "x", "max_tokens": 800, "ignore_eos": True, "stream": True}) as s:
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            time.sleep(1.5)  # the replicas report again (every second)
            holder = max(replicas(), key=lambda r: stats(r)["running"])
            ray.kill(holder.actor, no_restart=False)
            try:
                rest = [line for line in lines if line.startswith("data: ")]
            except httpx.TimeoutException:
                pytest.fail(f"the stream hung for {TIMEOUT} s after its replica was killed")
            except httpx.HTTPError:  # a broken stream is an error too
                rest = ["data: error: the stream broke"]
            assert not rest or rest[-1] != "data: [DONE]" or any(
                "error" in line for line in rest)
        after = http.post("/v1/completions", json={"prompt": "y", "max_tokens": 8})
        assert after.status_code == 200
    deadline = time.monotonic() + 180
    while len(replicas()) < 2:
        assert time.monotonic() < deadline, "Serve did not restart the replica"
        time.sleep(1)


def test_the_router_ranks_by_room_then_free_pages_then_waiting():
    """Replicas with unequal budgets, as the router sees them: one where a request of its split
    size fits comes first, the one with more free pages first among those; each request sent
    since a replica's report counts against its room until a report taken after it, or until
    it expires; a replica gone from the deployment leaves no entry."""
    router = object.__new__(FreePagesRouter)
    router.initialize_state()
    now = [100.0]
    router.clock = lambda: now[0]
    big = SimpleNamespace(replica_id="big", routing_stats={
        "room": 5, "free_pages": 900, "waiting": 0, "at": 99.0})
    small = SimpleNamespace(replica_id="small", routing_stats={
        "room": 1, "free_pages": 100, "waiting": 0, "at": 99.0})
    full = SimpleNamespace(replica_id="full", routing_stats={
        "room": 0, "free_pages": 950, "waiting": 3, "at": 99.0})

    def order(*candidates) -> list[str]:
        return [r[0].replica_id for r in asyncio.run(router.choose_replicas(list(candidates)))]

    assert order(full, small, big) == ["big", "small", "full"]
    router._replicas = {"big": big, "small": small, "full": full}
    for _ in range(5):
        now[0] += 0.1
        router.on_request_routed(None, "big", None)
    assert order(full, small, big) == ["small", "full", "big"]  # big has no room left now
    # a report taken after three of the five: its room (2) counts those, the other two not
    big.routing_stats = {**big.routing_stats, "room": 2, "at": 100.35}
    assert order(small, big) == ["small", "big"]
    big.routing_stats = {**big.routing_stats, "room": 5, "at": 100.6}  # after all five
    assert order(small, big) == ["big", "small"]
    now[0] = 101.0
    for _ in range(5):
        router.on_request_routed(None, "big", None)
    assert order(small, big) == ["small", "big"]
    now[0] += 6.0  # no report for longer than SENT_TTL: what was sent no longer counts
    assert order(small, big) == ["big", "small"] and router.sent["big"] == []
    router._replicas = {"small": small}  # big left the deployment: its entries go
    router.on_request_routed(None, "small", None)
    assert set(router.sent) == {"small"}


def test_autoscaling_keeps_kv_utilisation_at_its_target():
    policy = KVUsagePolicy(target=0.5)
    ctx = SimpleNamespace(target_num_replicas=2, aggregated_metrics={
        "kv_usage": {"a": 0.9, "b": 0.8}, "waiting_rows": {"a": 0.5, "b": 0.0}})
    assert policy(ctx)[0] == 5  # demand 2.2 replicas' worth at 0.5 each
    ctx.aggregated_metrics = {"kv_usage": {"a": 0.1, "b": 0.1}, "waiting_rows": {}}
    assert policy(ctx)[0] == 1
    ctx.aggregated_metrics = {}
    assert policy(ctx)[0] == 2  # no report yet: as it is


def test_the_serve_deploy_file_holds_the_application(model_folder, tmp_path):
    """The application by import path with its arguments; never the API key itself (a key
    file's path, which each replica reads)."""
    config = ServeConfig(model=model_folder, method=METHOD, memory="300KB", port=8123)
    file = deploy_config(config, Scale(replicas=None, min_replicas=1, max_replicas=3))
    app = file["applications"][0]
    assert app["import_path"] == "kvmix.serving.replicas:build_application"
    assert app["args"]["method"] == METHOD and app["args"]["scale"]["max_replicas"] == 3
    assert file["http_options"] == {"host": "127.0.0.1", "port": 8123}
    with pytest.raises(ValueError, match="valid methods"):
        deploy_config(replace(config, method="kivi9"), Scale())
    with pytest.raises(ValueError, match="api_key is not written"):
        deploy_config(replace(config, api_key="secret"), Scale())
    secret = tmp_path / "key"
    secret.write_text("file-key\n")
    args = deploy_config(replace(config, api_key_file=str(secret)), Scale())[
        "applications"][0]["args"]
    assert args["api_key"] is None and args["api_key_file"] == str(secret)
    assert ServeConfig(api_key_file=str(secret)).key() == "file-key"
    with pytest.raises(ValueError, match="api_key_file="):
        ServeConfig(api_key_file=str(tmp_path / "none")).key()


@pytest.mark.parametrize(("argv", "message"), [
    (["--replicas", "2"], "go with --ray or --ray-config"),
    (["--ray", "--replicas", "2", "--min-replicas", "1"], "not both"),
    (["--ray", "--min-replicas", "3", "--max-replicas", "2"], "min_replicas=3, max_replicas=2"),
    (["--ray", "--replica-cpus", "0"], "cpus=0.0"),
    (["--ray", "--address", "127.0.0.1:1"], "no Ray cluster answers there"),
    (["--ray", "--method", "kivi9"], "valid methods"),
    (["--ray", "--model", "/no/such/model"], "cannot be loaded"),
])
def test_bad_ray_settings_fail_before_any_work(argv, message, model_folder, capsys,
                                               monkeypatch):
    from kvmix.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", model_folder, "--memory", "300KB", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_without_the_extra_ray_is_refused_with_the_install_line(monkeypatch, capsys):
    import importlib.util

    from kvmix.cli import main

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("ray") else found(name, *a))
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--ray"])
    assert exit_.value.code == 2 and "pip install 'kvmix[ray]'" in capsys.readouterr().err


def test_the_ray_config_file_is_what_serve_deploy_takes(model_folder, tmp_path):
    """``--ray-config`` writes the YAML; its import path builds the same deployment: the
    router, the budget's concurrency, one replica per node, autoscaling bounds."""
    import yaml

    from kvmix.cli import main
    from kvmix.serving.replicas import build_application

    path = tmp_path / "serve.yaml"
    main(["serve", "--model", model_folder, "--method", METHOD, "--memory", "300KB",
          "--fit-prompt", "64", "--max-tokens", "24", "--min-replicas", "1",
          "--max-replicas", "4", "--ray-config", str(path)])
    app = yaml.safe_load(path.read_text())["applications"][0]
    deployment = build_application(app["args"])._bound_deployment
    config = deployment._deployment_config
    assert config.max_ongoing_requests == 9  # the budget's rows
    assert config.autoscaling_config.max_replicas == 4
    assert config.request_router_config.request_router_class.endswith("FreePagesRouter")
