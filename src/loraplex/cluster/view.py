"""`ClusterView`: the ingress's picture of its engine replicas, from which the routing policy chooses.

Each replica's report (messages.py) comes through Ray: Ray calls the replica's `record_routing_stats`
every `request_routing_stats_period_s` and hands the result to the request router (router.py), which puts it here.
A report is a little old when it is read, so the view corrects it for what this ingress did since:
- a job sent but not yet counted in the replica's `received` counter for this ingress is added to the replica's
  stats as the policy would assume it (`routing.with_request`: a seat, its KV blocks, its adapters' slots);
- a job this ingress saw end but not yet counted in `ended` gives its seat back.

A replica is **ready** (routed to) when its last report says so, this ingress has pushed its adapter registry to it
at the version that requires (`mark_synced`: so a replica Ray restarted gets the run-time adapters before its first
request), and it has not failed under this ingress (`mark_failed`: a dead actor; Ray replaces it with a new id).

The request router runs on Ray's router thread and the proxy engine on the ingress's event loop: every method
takes the lock. One view per (application, deployment) in a process (`view_for`).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace

from .messages import report_to_stats
from .routing import (OUTPUT_RESERVE, Policy, ReplicaStats, RoundRobinState, RouteRequest, choose_replica,
                      with_request)


@dataclass
class _Replica:
    report: dict = field(default_factory=dict)
    # jobs sent, not yet counted by the replica: key → (monotonic time sent, RouteRequest)
    pending: OrderedDict = field(default_factory=OrderedDict)
    sent: int = 0          # jobs this ingress sent it
    ended: int = 0         # of those, jobs this ingress saw end
    synced: int = -1       # the registry version this ingress last pushed to it
    failed: bool = False


class ClusterView:
    def __init__(self, origin: str | None = None, policy: Policy = Policy.CONSOLIDATE,
                 output_reserve: float = OUTPUT_RESERVE, target_batch: int | None = None) -> None:
        self.origin = origin or f"{socket.gethostname()}:{os.getpid()}"
        self.policy = Policy(policy)
        self.output_reserve = output_reserve
        self.target_batch = target_batch   # consolidation's target (routing.choose_replica); None: off
        self.gated = False         # an ingress attached: readiness needs its registry pushed (`mark_synced`)
        self.required_version = 0  # the registry version a replica must have to be routed to
        self.updates = 0           # reports taken so far (a waiter polls it)
        self._replicas: dict[str, _Replica] = {}
        self._routed: dict[str, str] = {}   # job key → the replica it was sent to, until `forget`
        self._rr = RoundRobinState()
        self._lock = threading.Lock()

    # ---- from the request router --------------------------------------------------------------------
    def update(self, reports: dict[str, dict]) -> None:
        """The replicas Ray runs now (id → latest report; {} before the first one); others are forgotten."""
        with self._lock:
            for rid in set(self._replicas) - set(reports):
                del self._replicas[rid]
            for rid, report in reports.items():
                entry = self._replicas.setdefault(rid, _Replica())
                if report and report != entry.report:
                    entry.report = dict(report)
                    unseen = entry.sent - int(report.get("received", {}).get(self.origin, 0))
                    while len(entry.pending) > max(unseen, 0):
                        entry.pending.popitem(last=False)
                _expire(entry)
            self.updates += 1

    # ---- from the proxy engine ----------------------------------------------------------------------
    def note_sent(self, replica_id: str, key: str, route: RouteRequest) -> None:
        """Job `key` goes to `replica_id` (once per key: a job routed again is moved, not counted twice)."""
        with self._lock:
            before = self._routed.get(key)
            if before == replica_id:
                return
            if before is not None and before in self._replicas:
                old = self._replicas[before]
                if old.pending.pop(key, None) is not None:
                    old.sent -= 1
            entry = self._replicas.get(replica_id)
            if entry is not None:
                self._routed[key] = replica_id
                entry.sent += 1
                entry.pending[key] = (time.monotonic(), route)

    def routed(self, key: str) -> str | None:
        """The replica job `key` was sent to (None: not routed yet)."""
        with self._lock:
            return self._routed.get(key)

    def forget(self, key: str) -> None:
        """Job `key` is over (its stream ended here)."""
        with self._lock:
            self._routed.pop(key, None)

    def note_ended(self, replica_id: str) -> None:
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is not None:
                entry.ended += 1

    def mark_failed(self, replica_id: str) -> None:
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is not None:
                entry.failed = True

    def mark_synced(self, replica_id: str, version: int) -> None:
        with self._lock:
            entry = self._replicas.get(replica_id)
            if entry is not None:
                entry.synced = max(entry.synced, version)

    def needs_sync(self, version: int) -> list[str]:
        """Live replicas this ingress has not pushed registry `version` to."""
        with self._lock:
            return sorted(rid for rid, e in self._replicas.items() if not e.failed and e.synced < version)

    # ---- reading ------------------------------------------------------------------------------------
    def replica_ids(self) -> list[str]:
        with self._lock:
            return sorted(rid for rid, e in self._replicas.items() if not e.failed)

    def reports(self) -> dict[str, dict]:
        """Each live replica's latest report (copies), for the metrics."""
        with self._lock:
            return {rid: dict(e.report) for rid, e in self._replicas.items() if not e.failed}

    def stats(self) -> list[ReplicaStats]:
        """Every replica's stats as the policy should see them now (module docstring)."""
        with self._lock:
            return [self._stats(rid, e) for rid, e in sorted(self._replicas.items())]

    def choose(self, route: RouteRequest, exclude: frozenset[str] = frozenset(),
               assume: list[tuple[str, RouteRequest]] = ()) -> str | None:
        """The replica `route` should go to (routing.choose_replica under this view's policy), or None; `assume`:
        placements decided but not yet sent (router queue), counted as sent."""
        with self._lock:
            stats, pinned = {}, {}
            for rid, entry in self._replicas.items():
                stats[rid], pinned[rid] = self._stats_pinned(rid, entry)
            for rid, placed in assume:
                if rid in stats:
                    stats[rid], pinned[rid] = self._assume(stats[rid], placed, pinned[rid])
            return choose_replica(route, list(stats.values()), self.policy, exclude=exclude, rr_state=self._rr,
                                  output_reserve=self.output_reserve, target_batch=self.target_batch)

    def peer_rooms(self) -> dict[str, list[int]]:
        """For each live replica, the free KV blocks of the other ready replicas that have a free seat: where a
        request it would preempt could go instead (replica_engine.PeerRoom)."""
        stats = [s for s in self.stats() if s.ready and s.running + s.waiting < s.max_running]
        return {rid: [s.free_kv_blocks for s in stats if s.replica_id != rid] for rid in self.replica_ids()}

    def _stats(self, rid: str, entry: _Replica) -> ReplicaStats:
        return self._stats_pinned(rid, entry)[0]

    def _stats_pinned(self, rid: str, entry: _Replica) -> tuple[ReplicaStats, frozenset[str]]:
        """The replica's stats, and the adapters its requests (running, queued, on the way) hold slots for."""
        ready = not entry.failed and (not self.gated or entry.synced >= self.required_version)
        stats = report_to_stats(rid, entry.report, ready=ready)
        # adapters whose slots the replica's running and queued requests hold or will hold
        report = entry.report
        pinned = frozenset(report.get("running_adapters", ())) | frozenset(report.get("waiting_adapters", ()))
        if not entry.report:
            return stats, pinned
        ended_unseen = max(entry.ended - int(entry.report.get("ended", {}).get(self.origin, 0)), 0)
        if ended_unseen:   # seats given back: running ones first
            absorbed = min(stats.running, ended_unseen)
            stats = replace(stats, running=stats.running - absorbed,
                            waiting=max(stats.waiting - (ended_unseen - absorbed), 0))
        for _, route in entry.pending.values():
            stats, pinned = self._assume(stats, route, pinned)
        return stats, pinned

    def _assume(self, stats: ReplicaStats, route: RouteRequest,
                pinned: frozenset[str]) -> tuple[ReplicaStats, frozenset[str]]:
        """`routing.with_request`, and the slot a member takes that is on the GPU but held for no request: once
        the request runs, it pins it (with_request counts only the slots of the members it loads)."""
        newly = len([a for a in route.adapters if a in stats.gpu_adapters and a not in pinned])
        stats = with_request(stats, route, self.output_reserve)
        if newly:
            stats = replace(stats, free_gpu_slots=max(stats.free_gpu_slots - newly, 0))
        return stats, pinned | frozenset(route.adapters)


PENDING_TTL_S = 10.0   # a job not counted by its replica after this long was lost on the way (or Ray rerouted it)


def _expire(entry: _Replica) -> None:
    now = time.monotonic()
    while entry.pending and now - next(iter(entry.pending.values()))[0] > PENDING_TTL_S:
        entry.pending.popitem(last=False)
        entry.sent -= 1


_VIEWS: dict[str, ClusterView] = {}
_VIEWS_LOCK = threading.Lock()


def view_for(app_name: str, deployment: str) -> ClusterView:
    """The process's view of one deployment's replicas (made on first use)."""
    with _VIEWS_LOCK:
        return _VIEWS.setdefault(f"{app_name}#{deployment}", ClusterView())
