"""The ingress's background work, every `UPKEEP_S`:
- push the adapter registry to each replica this ingress has not pushed the current version to (a new replica, or
  one Ray restarted, is not routed to until then: view.py);
- tell each replica the free KV blocks of the others that have a seat (where a request it would preempt can
  migrate: replica_engine.py), when they changed;
- refresh the per-replica and aggregated gauges (cluster_metrics.py).

`push` and `push_later` are what `ClusterAdapters` calls after a change: the first, on a worker thread, returns once
every replica has the registry.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

from .proxy_engine import ClusterEngine

log = logging.getLogger("loraplex.cluster")

UPKEEP_S = 0.1
PEERS_EVERY_S = 0.25   # at most this often per replica: free blocks change with every step
PUSH_TIMEOUT_S = 120.0


class Upkeep:
    def __init__(self, engine: ClusterEngine, migration: bool = True) -> None:
        self.engine, self.migration = engine, migration
        self.adapters = engine.engine.adapters
        self._loop = asyncio.get_running_loop()
        self._syncing: dict[str, asyncio.Task] = {}
        self._peers_sent: dict[str, list[int]] = {}
        self._peers_at = 0.0
        self._task = self._loop.create_task(self._run())
        self.adapters.push, self.adapters.push_later = self.push, self.push_later

    def stop(self) -> None:
        self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:   # a bug here must not stop the upkeep
                log.exception("cluster upkeep")
            await asyncio.sleep(UPKEEP_S)

    def tick(self) -> None:
        view, version = self.engine.view, self.adapters.version
        for rid in view.needs_sync(version):
            if rid not in self._syncing or self._syncing[rid].done():
                self._syncing[rid] = self._loop.create_task(self._sync(rid))
        now = self._loop.time()
        if self.migration and now - self._peers_at >= PEERS_EVERY_S:
            self._peers_at = now
            for rid, free in view.peer_rooms().items():
                if self._peers_sent.get(rid) != free:
                    self._peers_sent[rid] = free
                    self._loop.create_task(self._call(rid, "peers", free))
        reports = view.reports()
        ready = {s.replica_id for s in view.stats() if s.ready}
        self.engine.metrics.set_replicas(reports, ready, self.engine.engine.config.max_gpu_adapters)

    async def sync_all(self) -> None:
        """Push the registry to every live replica and wait for all (those that fail stay unready)."""
        await asyncio.gather(*(self._sync(rid) for rid in self.engine.view.replica_ids()))

    def push(self) -> None:
        """From a worker thread: `sync_all` on the ingress's loop, waited for."""
        asyncio.run_coroutine_threadsafe(self.sync_all(), self._loop).result(PUSH_TIMEOUT_S)

    def push_later(self) -> None:
        """From the event loop (or any thread): the next ticks push it."""

    async def _sync(self, rid: str) -> None:
        registry = self.adapters.snapshot()
        try:
            version = await self.engine.control(rid, "sync_adapters", registry)
        except Exception as e:   # retried by the next tick while the replica lives
            log.warning("pushing the adapter registry to replica %s failed: %r", rid, e)
            return
        self.engine.view.mark_synced(rid, version)

    async def _call(self, rid: str, op: str, args) -> None:
        with contextlib.suppress(Exception):   # a replica that is leaving: the next tick knows
            await self.engine.control(rid, op, args, timeout=10.0)
