"""``kvmix serve --ray``: replicas of ``kvmix serve`` on Ray Serve (docs/guide/ray.md), routed by
free packed pages and autoscaled on KV utilisation. Ray is the cluster manager, the router and the
autoscaler; kvmix supplies what they decide on.

* ``Replica`` — the deployment. Its constructor builds what ``kvmix serve`` builds (model,
  manager, cache sized from the budget — once per replica) and it serves the same app
  (``build_app``: routes, parameters, API key, metrics). It reports how many requests of the
  size its budget is split for fit its unreserved pages now (``record_routing_stats``) and its
  KV utilisation (``record_autoscaling_stats``); a dead generation loop fails its health check,
  so Serve replaces it.
* ``FreePagesRouter`` — a ``RequestRouter``. Serve's proxy streams a request's body to the
  replica after routing, so the router cannot read the request: it ranks replicas by whether a
  request of their split size fits now (less the requests it sent since their last report),
  then by free pages, then by waiting requests. A replica refuses what can never fit it (400)
  and keeps what does not fit yet waiting, in order.
* ``kv_usage_policy`` — the autoscaling policy: as many replicas as keep the mean share of the
  budget reserved (waiting requests counted as rows they would take) at ``target``.

``application`` binds the deployment for ``serve.run``; ``deploy_config`` is the file
``serve deploy`` takes for the same thing (``build_application`` is its import path).
"""

from __future__ import annotations

import math
import time
from dataclasses import fields, replace
from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig
from ray.serve.request_router import FIFOMixin, RequestRouter

from kvmix.jobs.ray import reachable
from kvmix.serving.launch import Scale, ServeConfig, build, check, planned_rows

ROUTER = "kvmix.serving.replicas:FreePagesRouter"
POLICY = "kvmix.serving.replicas:KVUsagePolicy"
STATS_PERIOD = 1.0  # seconds between a replica's routing reports


SENT_TTL = 5.0  # seconds a request sent to a replica counts against its room, unreported


class Replica:
    """One ``kvmix serve`` as a Ray Serve replica (decorated by ``application``)."""

    def __init__(self, config: ServeConfig):
        from kvmix.serving.server import build_app

        self.manager, tokenizer, self.line = build(config)
        self.manager.start()
        self.asgi = build_app(self.manager, tokenizer, config.model, config.limits())

    async def __serve_build_asgi_app__(self) -> Any:
        return self.asgi

    def record_routing_stats(self) -> dict[str, float]:
        """Requests of the split size that fit now, unreserved pages, requests waiting and
        running, requests started so far, and when."""
        figures = self.manager.stats.snapshot()
        return {"room": figures.get("room", 1.0),
                "free_pages": figures.get("pages_unreserved", 0.0),
                "waiting": figures["waiting"], "running": figures["running"],
                "started": figures["ttft_count"], "at": time.time()}

    def record_autoscaling_stats(self) -> dict[str, float]:
        figures = self.manager.stats.snapshot()
        rows = max(figures.get("rows", 1.0), 1.0)
        return {"kv_usage": figures.get("kv_usage", 0.0), "waiting_rows":
                figures["waiting"] / rows}

    def check_health(self) -> None:
        status = self.manager.background_thread_status
        if status.fatal_error is not None or not self.manager.is_running():
            raise RuntimeError(f"the generation loop died: {status.fatal_error}")

    def __del__(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None and manager.is_running():
            manager.stop(block=True, timeout=10)


class FreePagesRouter(FIFOMixin, RequestRouter):
    """Replicas ranked one per rank: those where a request of their split size fits now
    first, by pages free after reservations, then the others by waiting requests (Serve tries
    them in turn and backs off when none takes the request: it waits, it does not fail).

    A replica reports every second; each request sent to it since its report counts against
    its room, until a report taken after it arrives or ``SENT_TTL`` seconds pass."""

    clock = staticmethod(time.time)

    def initialize_state(self, **kwargs: Any) -> None:
        self.sent: dict[Any, list[float]] = {}  # replica -> when each request went to it

    async def choose_replicas(self, candidate_replicas: list, pending_request: Any = None
                              ) -> list[list]:
        return [[replica] for replica in sorted(candidate_replicas, key=self._rank)]

    def on_request_routed(self, pending_request: Any, replica_id: Any, result: Any) -> None:
        self.sent.setdefault(replica_id, []).append(self.clock())
        for gone in self.sent.keys() - set(self.curr_replicas) - {replica_id}:
            del self.sent[gone]

    def _unreported(self, replica: Any) -> int:
        """Requests sent to ``replica`` after its last report, within ``SENT_TTL`` (the
        others are dropped)."""
        since = max((replica.routing_stats or {}).get("at", 0.0), self.clock() - SENT_TTL)
        times = [t for t in self.sent.get(replica.replica_id, []) if t > since]
        self.sent[replica.replica_id] = times
        return len(times)

    def _rank(self, replica: Any) -> tuple[float, float, float]:
        stats = replica.routing_stats or {}
        room = stats.get("room", 1.0) - self._unreported(replica)
        return (0.0 if room >= 1 else 1.0, -stats.get("free_pages", 0.0),
                stats.get("waiting", 0.0) + max(-room, 0))


class KVUsagePolicy:
    """Autoscaling: as many replicas as keep the mean KV utilisation at ``target``, waiting
    requests counted as the share of a replica's rows they would take (Serve applies the
    bounds and delays)."""

    def __init__(self, target: float = 0.7):
        self.target = target

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        metrics = ctx.aggregated_metrics or {}
        usage, waiting = metrics.get("kv_usage", {}), metrics.get("waiting_rows", {})
        if not usage:
            return ctx.target_num_replicas, {}
        demand = sum(usage.values()) + sum(waiting.values())
        return math.ceil(demand / self.target), {}


def options(config: ServeConfig, scale: Scale) -> dict[str, Any]:
    """The deployment's options: resources, concurrency from the budget, router, scaling."""
    actor = {"num_cpus": scale.cpus, **({"num_gpus": scale.gpus} if scale.gpus else {})}
    chosen: dict[str, Any] = {
        "name": "kvmix", "ray_actor_options": actor,
        "max_ongoing_requests": planned_rows(config),
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=STATS_PERIOD),
        "health_check_period_s": 2.0, "graceful_shutdown_timeout_s": config.drain_timeout}
    if scale.per_node:
        chosen["max_replicas_per_node"] = scale.per_node
    if scale.replicas is not None:
        chosen["num_replicas"] = scale.replicas
    else:
        chosen["autoscaling_config"] = AutoscalingConfig(
            min_replicas=scale.min_replicas, max_replicas=scale.max_replicas,
            initial_replicas=max(scale.min_replicas, 1), metrics_interval_s=STATS_PERIOD,
            look_back_period_s=10.0, upscale_delay_s=5.0, downscale_delay_s=60.0,
            policy=AutoscalingPolicy(policy_function=POLICY,
                                     policy_kwargs={"target": scale.target}))
    return chosen


def application(config: ServeConfig, scale: Scale) -> Any:
    """The bound deployment for ``serve.run``; bad settings are refused here, before Ray
    places anything."""
    check(config)
    deployment = serve.deployment(serve.ingress()(Replica))
    # the key resolved here, where the environment or the file is, travels with the bound
    # arguments (Ray's object store, not a file) to every replica on every node
    return deployment.options(**options(config, scale)).bind(
        replace(config, api_key=config.key(), api_key_file=None))


def build_application(args: dict[str, Any]) -> Any:
    """``serve deploy``'s import path: the application from the arguments ``deploy_config``
    wrote (a ``ServeConfig`` and a ``Scale``)."""
    names = {f.name for f in fields(ServeConfig)}
    config = ServeConfig(**{k: v for k, v in args.items() if k in names})
    scale = Scale(**args.get("scale", {}))
    return application(config, scale)


def serve_on_ray(config: ServeConfig, scale: Scale, address: str | None,
                 say: Any = print) -> None:
    """Replicas on the Ray cluster at ``address`` (None: a local Ray for this process) behind
    Serve's proxy on ``config.host:config.port``, until SIGTERM/SIGINT; a cluster that cannot be
    reached, or a replica that cannot start, is a ValueError naming the cause."""
    import signal
    import threading

    import ray

    app = application(config, scale)
    reachable(address)
    try:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    except (ConnectionError, RuntimeError, ValueError) as error:
        raise ValueError(f"address={address!r}: no Ray cluster could be reached ({error})") \
            from None
    try:
        serve.start(http_options={"host": config.host, "port": config.port})
        serve.run(app, name="kvmix", route_prefix="/")
    except RuntimeError as error:
        serve.shutdown()
        ray.shutdown()
        raise ValueError(f"the replicas did not start: {error}") from None
    deployment = serve.status().applications["kvmix"].deployments["kvmix"]
    say(f"kvmix serve --ray · {config.model} · {config.method} · "
        f"{sum(deployment.replica_states.values())} "
        f"replicas of {config.memory} each, routed by free pages; listening on "
        f"http://{config.host}:{config.port}")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    serve.shutdown()
    ray.shutdown()
