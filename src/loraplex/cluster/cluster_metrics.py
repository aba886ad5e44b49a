"""Prometheus series of a cluster, served by the ingress's `/metrics` beside the server's own.

Aggregated: the server's `ServerMetrics` counts requests, tokens and latencies as for one engine (every request
passes the ingress), and its engine gauges (running, waiting, KV usage, adapters by tier) are set here from the
replicas' reports, summed. Per replica (label `replica`: Ray's replica id):

| series | what |
|---|---|
| `loraplex_replica_requests{replica,outcome}` | attempts ended there: stop, length, abort, error, migrated, failed |
| `loraplex_replica_generation_tokens{replica}` | tokens it generated |
| `loraplex_replica_time_to_first_token_seconds{replica}` | TTFT (from the ingress) where it made the first token |
| `loraplex_replica_num_requests_running{replica}`, `..._waiting{replica}` | its batch and its scheduler's queue |
| `loraplex_replica_kv_cache_usage_ratio{replica}` | KV blocks in use, 0..1 |
| `loraplex_replica_adapters{replica,tier}` | its adapters by tier (gpu, cpu, disk, loading, failed) |
| `loraplex_replica_ready{replica}` | 1 while the router sends it requests |
| `loraplex_replica_busy_seconds{replica}` | wall time of its engine steps since it started (busy time; only rises) |
| `loraplex_migrations{replica}` | requests moved off it for lack of KV memory |
| `loraplex_retries{replica}` | requests resumed elsewhere because it failed |
| `loraplex_router_queue_length{kind}` | requests waiting at the router: new ones (`queued`), moving ones (`moving`) |
| `loraplex_router_rejected` | requests refused (429) because the router queue was full |

Gauges of a replica that left the cluster are removed with it.
"""
from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

from ..engine.outputs import RequestOutput
from ..server.metrics import TIERS, TTFT_BUCKETS, EngineSnapshot, ServerMetrics
from .cluster_request import ClusterRequest
from .messages import report_to_stats

OUTCOMES = ("stop", "length", "abort", "error", "migrated", "failed")


class ClusterMetrics:
    def __init__(self, server: ServerMetrics) -> None:
        self.server = server
        r = server.registry
        self._requests = Counter("loraplex_replica_requests", "Attempts that ended on a replica, by outcome",
                                 ["replica", "outcome"], registry=r)
        self._tokens = Counter("loraplex_replica_generation_tokens", "Tokens generated on a replica", ["replica"],
                               registry=r)
        self._ttft = Histogram("loraplex_replica_time_to_first_token_seconds", "Time from arrival at the ingress "
                               "to the first token, by the replica that made it", ["replica"], buckets=TTFT_BUCKETS,
                               registry=r)
        self._running = Gauge("loraplex_replica_num_requests_running", "Requests in a replica's running batch",
                              ["replica"], registry=r)
        self._waiting = Gauge("loraplex_replica_num_requests_waiting", "Requests waiting in a replica's scheduler",
                              ["replica"], registry=r)
        self._kv = Gauge("loraplex_replica_kv_cache_usage_ratio", "Fraction of a replica's KV blocks in use",
                         ["replica"], registry=r)
        self._tiers = Gauge("loraplex_replica_adapters", "A replica's adapters by tier", ["replica", "tier"],
                            registry=r)
        self._ready = Gauge("loraplex_replica_ready", "1 while the router sends the replica requests", ["replica"],
                            registry=r)
        self._busy = Gauge("loraplex_replica_busy_seconds", "Wall time of a replica's engine steps since it started "
                           "(only rises)", ["replica"], registry=r)
        self._migrations = Counter("loraplex_migrations", "Requests moved off a replica short of KV memory",
                                   ["replica"], registry=r)
        self._retries = Counter("loraplex_retries", "Requests resumed elsewhere after their replica failed",
                                ["replica"], registry=r)
        self._queue = Gauge("loraplex_router_queue_length", "Requests waiting at the router for a replica with room",
                            ["kind"], registry=r)
        self._rejected = Counter("loraplex_router_rejected", "Requests refused because the router queue was full",
                                 registry=r)
        self._known: set[str] = set()

    # ---- events at the ingress --------------------------------------------------------------------
    def output(self, replica: str | None, req: ClusterRequest, out: RequestOutput) -> None:
        """An output of `req` made on `replica`."""
        label = replica or "unknown"
        if out.new_token_ids:
            self._tokens.labels(label).inc(len(out.new_token_ids))
            if len(req.generated) == len(out.new_token_ids) and req.first_token is not None:
                self._ttft.labels(label).observe(req.first_token - req.arrival)
        if out.finished and out.finish_reason in OUTCOMES:
            self._requests.labels(label, out.finish_reason).inc()

    def migrated(self, replica: str | None) -> None:
        self._migrations.labels(replica or "unknown").inc()
        self._requests.labels(replica or "unknown", "migrated").inc()

    def retried(self, replica: str | None) -> None:
        self._retries.labels(replica or "unknown").inc()
        self._requests.labels(replica or "unknown", "failed").inc()

    def rejected(self) -> None:
        self._rejected.inc()

    def set_queue(self, queued: int, moving: int) -> None:
        self._queue.labels("queued").set(queued)
        self._queue.labels("moving").set(moving)

    # ---- the replicas' reports --------------------------------------------------------------------
    def _forget(self, replica: str) -> None:
        """Drop the gauges of a replica that left the cluster."""
        series = [(g, (replica,)) for g in (self._running, self._waiting, self._kv, self._ready, self._busy)]
        for gauge, labels in series + [(self._tiers, (replica, tier)) for tier in TIERS]:
            with contextlib.suppress(KeyError):   # (never set: it left before its first report)
                gauge.remove(*labels)

    def set_replicas(self, reports: dict[str, dict], ready: set[str], max_gpu_adapters: int) -> None:
        """Per-replica gauges from their latest reports, and the server's engine gauges summed over them."""
        for gone in self._known - set(reports):
            self._forget(gone)
        self._known = set(reports)
        totals = {"running": 0, "waiting": 0, "used": 0, "total": 0}
        tiers = dict.fromkeys(TIERS, 0)
        running_adapters: set[str] = set()
        waiting_adapters: set[str] = set()
        for rid, report in reports.items():
            self._ready.labels(rid).set(int(rid in ready))
            if not report:
                continue
            stats = report_to_stats(rid, report, ready=True)
            used = stats.total_kv_blocks - min(stats.free_kv_blocks, stats.total_kv_blocks)
            self._running.labels(rid).set(stats.running)
            self._busy.labels(rid).set(float(report.get("busy_s", 0.0)))
            self._waiting.labels(rid).set(stats.waiting)
            self._kv.labels(rid).set(used / stats.total_kv_blocks if stats.total_kv_blocks else 0.0)
            for tier in TIERS:
                count = int(report.get("tiers", {}).get(tier, 0))
                self._tiers.labels(rid, tier).set(count)
                tiers[tier] += count
            totals["running"] += stats.running
            totals["waiting"] += stats.waiting
            totals["used"] += used
            totals["total"] += stats.total_kv_blocks
            running_adapters.update(report.get("running_adapters", ()))
            waiting_adapters.update(report.get("waiting_adapters", ()))
        self.server.set_engine(EngineSnapshot(
            num_running=totals["running"], num_waiting=totals["waiting"], kv_blocks_used=totals["used"],
            kv_blocks_total=totals["total"], running_adapters=sorted(running_adapters),
            waiting_adapters=sorted(waiting_adapters),
            adapters_by_tier=tiers, max_gpu_adapters=max_gpu_adapters))
