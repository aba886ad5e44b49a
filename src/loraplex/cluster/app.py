"""loraplex's Ray Serve application: N engine replicas (one per GPU) behind one ingress serving the OpenAI API.

    serve run loraplex.cluster.app:build_app replicas=2            # Ray Serve's CLI
    serve deploy examples/serve_config.yaml                          # a Serve config file (args: ClusterOptions)
    loraplex serve --replicas 2                                      # loraplex's CLI (`run_cluster`)

`build_app(args)` returns the application: the `EngineReplica` deployment with loraplex's request router and its
replicas' reports (`record_routing_stats`), bound into the `LoraplexIngress` deployment. docs/cluster.md describes
the design; the README how to run it.
"""
from __future__ import annotations

import signal
import sys
import threading
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from .ingress import LoraplexIngress
from .options import ClusterOptions
from .replica import EngineReplica
from .router import LoraplexRequestRouter

APP_NAME = "loraplex"
UNBOUNDED = 1_000_000   # Ray's per-replica request cap, left to loraplex's router (router.py)


def build_app(args: dict[str, Any] | None = None) -> serve.Application:
    """The application for `serve run` / a Serve config file; `args` are `ClusterOptions`' fields."""
    opts = ClusterOptions.from_args(args)
    opts.check()
    gpus = opts.gpus_per_replica if opts.gpus_per_replica is not None else _default_gpus()
    router = RequestRouterConfig(request_router_class=LoraplexRequestRouter,
                                 request_routing_stats_period_s=opts.stats_period_s,
                                 request_routing_stats_timeout_s=max(10 * opts.stats_period_s, 5.0))
    replicas = serve.deployment(EngineReplica, name="EngineReplica").options(
        num_replicas=opts.replicas, max_ongoing_requests=UNBOUNDED, request_router_config=router,
        ray_actor_options={"num_gpus": gpus, "num_cpus": opts.cpus_per_replica},
        health_check_period_s=2.0, graceful_shutdown_timeout_s=5.0,
        logging_config={"enable_access_log": False},   # the ingress's control calls would flood it
    ).bind(opts.engine, opts.adapters, opts.packed, int(opts.server.get("synthetic_adapters", 0)), opts.migration)
    ingress = serve.deployment(LoraplexIngress, name="LoraplexIngress").options(
        num_replicas=1, max_ongoing_requests=UNBOUNDED, ray_actor_options={"num_cpus": 0})
    return ingress.bind(replicas, opts.to_args())


def _default_gpus() -> float:
    """One GPU per replica when the Ray cluster (or, before Ray starts, this machine) has GPUs, else none."""
    import ray
    if ray.is_initialized():
        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0
    import torch
    return 1.0 if torch.cuda.is_available() else 0.0


def run_cluster(args: dict[str, Any], *, ray_address: str | None = None) -> int:
    """`loraplex serve --replicas N`: join the Ray cluster at `ray_address` (else the one running here, else start
    one), serve the application at the server settings' host and port until SIGINT/SIGTERM, then remove it."""
    import ray

    opts = ClusterOptions.from_args(args)
    opts.check()
    host, port = opts.server.get("host", "127.0.0.1"), int(opts.server.get("port", 8000))
    if ray_address is not None:
        ray.init(address=ray_address)
    else:
        try:
            ray.init(address="auto")
        except ConnectionError:
            ray.init(include_dashboard=False)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(opts.to_args()), name=APP_NAME, route_prefix="/")
        print(f"loraplex: serving {opts.replicas} replica(s) at http://{host}:{port}/v1 (Ray Serve)",
              file=sys.stderr, flush=True)
        stop.wait()
        print("loraplex: stopping", file=sys.stderr, flush=True)
        serve.delete(APP_NAME)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
