"""`LoraplexRequestRouter`: Ray Serve's custom request router for the engine replicas, with loraplex's policy.

Ray Serve hands a deployment handle's requests to its request router, which picks a replica from the running ones
(`choose_replicas`) and is told when that set or the replicas' reports change (`update_replicas`; the reports are
what each replica's `record_routing_stats` returned). This router keeps those reports in the process's
`ClusterView` and routes:
- a `Job` with a `target` (placed by the router queue, proxy_engine.py) or a `Control`: to that replica;
- any other `Job`: to `routing.choose_replica` over the view (consolidation by default); none with room: no
  candidate, and Ray asks again after a short backoff (the ingress sends a job only once the view found room);
- anything else (e.g. a handle call with other arguments): any replica, as Ray would.

It declines Ray's rejection protocol: the policy already knows each replica's seats (set the replicas'
`max_ongoing_requests` high, as app.py does, so Ray's own per-replica cap never overrides it).
"""
from __future__ import annotations

from typing import List, Optional

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .messages import Control, Job
from .view import ClusterView, view_for


class LoraplexRequestRouter(RequestRouter):
    @property
    def view(self) -> ClusterView:
        deployment = self._deployment_id   # (set by RequestRouter.__init__)
        return view_for(deployment.app_name, deployment.name)

    @property
    def supports_rejection_protocol(self) -> bool:
        return False

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.view.update({r.replica_id.unique_id: dict(r.routing_stats or {}) for r in replicas})

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if isinstance(request, Control) or (isinstance(request, Job) and request.target is not None):
            chosen = by_id.get(request.target)
            return [[chosen]] if chosen is not None else []
        if isinstance(request, Job):
            rid = self.view.choose(request.route, request.exclude)
            if rid is None or rid not in by_id:
                return []
            self.view.note_sent(rid, request.key, request.route)
            return [[by_id[rid]]]
        return [candidate_replicas]
