"""What the ingress sends its engine replicas, and what they report back (no Ray here).

- `Job`: one engine request for a replica. The request router (router.py) reads its `route` and `exclude` to choose
  the replica; `resume` carries output tokens made elsewhere (a migration or a replica that died), which the
  replica takes as already generated (replica_engine.py), so the stream goes on where it stopped.
- `Control`: a call for one named replica (`target`), e.g. pushing the adapter registry to it.
- a replica's **report** (`record_routing_stats`: a plain dict, so that Ray can compare and ship it) holds
  `routing.ReplicaStats`' fields (ready, running, waiting, max_running, free_kv_blocks, total_kv_blocks, block_size,
  free_gpu_slots, gpu_adapters, cpu_adapters), the adapters its running and queued requests hold
  (running_adapters, waiting_adapters), adapters by tier, jobs received and ended by origin, busy seconds,
  migrations, its registry version and pid; `report_to_stats` reads it as the `ReplicaStats` the policy takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..adapters.composition import Composition
from ..sampling import SamplingParams
from .routing import ReplicaStats, RouteRequest


@dataclass(frozen=True)
class Job:
    """One engine request sent to a replica, chosen by the request router (router.py)."""
    key: str                          # unique per attempt: the replica's request id
    origin: str                       # the ingress that sent it (the replica counts jobs per origin)
    prompt: tuple[int, ...]
    params: SamplingParams
    adapter: str | Composition | None
    route: RouteRequest
    exclude: frozenset[str] = frozenset()   # replicas not to use (the one it migrates from, dead ones)
    resume: tuple[int, ...] = ()      # output tokens generated before, elsewhere
    target: str | None = None         # a replica chosen already (the router queue placed it)
    sources: dict[str, str] = field(default_factory=dict)   # run-time adapter → folder, for a replica lacking it


@dataclass(frozen=True)
class Control:
    """A call for one replica (`target`: its id); `op` names the replica method (replica.py), `args` its input."""
    target: str
    op: str
    args: Any = None


def route_of(prompt_tokens: int, params: SamplingParams, composition: Composition | None,
             generated: int = 0) -> RouteRequest:
    """What the router knows of a request: its adapters, the tokens to prefill (prompt plus tokens generated so
    far, for a request that moves), and the tokens it may still generate."""
    names = composition.names if composition is not None else ()
    return RouteRequest(adapters=names, prompt_tokens=prompt_tokens + generated,
                        max_new_tokens=max(params.max_tokens - generated, 0))


def report_to_stats(replica_id: str, report: dict, *, ready: bool) -> ReplicaStats:
    """The policy's view of one replica's report; `ready` also says whether the ingress may use it (synced)."""
    if not report:
        return ReplicaStats(replica_id, ready=False)
    return ReplicaStats(
        replica_id, ready=ready and bool(report.get("ready")), running=int(report["running"]),
        waiting=int(report["waiting"]), max_running=int(report["max_running"]),
        free_kv_blocks=int(report["free_kv_blocks"]), total_kv_blocks=int(report["total_kv_blocks"]),
        block_size=int(report["block_size"]), free_gpu_slots=int(report["free_gpu_slots"]),
        gpu_adapters=frozenset(report["gpu_adapters"]), cpu_adapters=frozenset(report["cpu_adapters"]))
