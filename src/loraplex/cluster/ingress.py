"""`LoraplexIngress`: the Ray Serve deployment that answers HTTP, with loraplex's own FastAPI app
(server/app.py: the same routes, checks and errors as `loraplex serve`) around a `ClusterEngine`.

One ingress replica: it holds the adapter registry and the router queue, and its work per request is light (the
engines run on the replicas).
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import replace

from ray import serve

from ..server.app import create_app
from ..server.metrics import ServerMetrics
from ..server.settings import ServerSettings
from ..server.state import ServerState, default_model_name
from ..server.tenants import KeyRing
from .cluster_adapters import ClusterAdapters, ClusterCore, PoolLimits
from .cluster_metrics import ClusterMetrics
from .options import ClusterOptions
from .proxy_engine import ClusterEngine
from .routing import Policy
from .upkeep import Upkeep
from .view import view_for

log = logging.getLogger("loraplex.cluster")

# The ingress's app: Serve builds an ingress from a function it calls after the class's constructor, in the
# replica's process (one ingress per process); the constructor leaves the app here for it.
_BUILT: dict = {}


def _ingress_asgi_app():
    return _BUILT.pop("app")


@serve.ingress(_ingress_asgi_app)
class LoraplexIngress:
    async def __init__(self, replicas, options: dict) -> None:
        opts = ClusterOptions(**options)
        self.state, self.upkeep = await start_ingress(replicas, opts)
        _BUILT["app"] = create_app(self.state, lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        try:
            yield
        finally:
            self.state.accepting = False
            self.upkeep.stop()
            self.state.engine.shutdown()


async def start_ingress(handle, opts: ClusterOptions) -> tuple[ServerState, Upkeep]:
    """The server's state around a `ClusterEngine` over the replicas behind `handle`, once one replica has
    described the model it serves."""
    view = view_for(handle.app_name, handle.deployment_name)
    view.gated, view.policy, view.target_batch = True, Policy(opts.policy), opts.target_batch
    info = await handle.describe.remote()
    config = info["config"]
    seats = opts.replicas * config.max_num_seqs   # the cluster's: bounds what the server keeps in flight
    cluster_config = replace(config, max_num_seqs=seats,
                             max_num_batched_tokens=max(config.max_num_batched_tokens, seats))
    adapters = ClusterAdapters(info["model_config"], PoolLimits(config.max_lora_rank, info["dtype"]), info["specs"],
                               view)
    core = ClusterCore(cluster_config, info["model_config"], info["tokenizer"], info["max_model_len"],
                       frozenset(info["eos_token_ids"]), adapters)
    settings = ServerSettings(**{**opts.server, "max_waiting_requests": opts.router_queue})
    keyring = KeyRing(settings.api_keys) if settings.api_keys is not None else None
    metrics = ServerMetrics(max_adapter_labels=settings.max_adapter_labels)
    engine = ClusterEngine(handle, view, core, ClusterMetrics(metrics), router_queue=opts.router_queue,
                           max_retries=opts.max_retries)
    model_name = settings.served_model_name or default_model_name(config.model)
    if model_name in info["specs"]:
        raise ValueError(f"an adapter is named {model_name!r}, like the base model; rename one "
                         f"(served_model_name sets the base model's name)")
    state = ServerState(engine, settings, metrics, model_name, keyring=keyring)
    state.register_existing({name: spec.source for name, spec in info["specs"].items()})
    upkeep = Upkeep(engine, migration=opts.migration)
    log.info("ingress ready: %d replica(s) of %s, policy %s", opts.replicas, model_name, opts.policy)
    return state, upkeep
