"""`EngineReplica`: one engine (`ReplicaEngine` on its `AsyncEngine` thread) as a Ray Serve deployment replica,
one per GPU (app.py deploys it; on a CPU machine, CPU replicas).

The ingress (proxy_engine.py) sends it `Job`s through the request router (router.py) and `Control` calls for this
replica alone; Ray calls `record_routing_stats` every `request_routing_stats_period_s` and ships the report to the
router, and `check_health`, which fails once the engine has died, so that Ray replaces the replica.

Adapters: the replica registers the adapters it was started with, like `loraplex serve` (folders, packed files,
synthetic ones); those registered at run time reach it through `sync_adapters` (the ingress pushes its registry to
every replica, and to a replica Ray restarted before it is routed to), and a job names the folders of its run-time
adapters in case one is missing. Weights load on first use.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any, AsyncIterator

from ..adapters import AdapterError
from ..config import EngineConfig
from ..engine.async_engine import AsyncEngine
from .messages import Control, Job
from .replica_engine import ReplicaEngine, Resumed, engine_report

log = logging.getLogger("loraplex.cluster")

REPORT_EVERY_S = 0.05   # how often the engine thread refreshes the report Ray collects


class EngineReplica:
    """A Ray Serve deployment class (app.py wraps it with `serve.deployment`)."""

    def __init__(self, engine: dict, adapters: dict[str, str] | None = None, packed: list[str] | None = None,
                 synthetic_adapters: int = 0, migration: bool = True) -> None:
        from ray import serve
        config = EngineConfig(**engine)
        self.engine = ReplicaEngine(config, migration=migration)
        try:
            self.initial = _register_initial(self.engine, adapters or {}, packed or [], synthetic_adapters)
        except BaseException:
            self.engine.close()
            raise
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.registry: dict[str, str] = {}   # run-time adapters (name → folder) pushed by the ingress
        self.removed: set[str] = set()       # initial adapters removed at run time
        self.registry_version = -1           # the ingress's version last synced (-1: never)
        # jobs by origin that the engine accepted (or that ended before), and that ended: the ingress counts a
        # job it sent as load until the report's engine numbers include it (view.py)
        self.received: Counter = Counter()
        self.ended: Counter = Counter()
        self.held_blocks = 0
        self._sync_lock = asyncio.Lock()
        self._report: dict = {}
        self._last_report = 0.0
        self._last_step = None
        self.busy_s = 0.0   # wall time of the engine's steps so far
        self.async_engine = AsyncEngine(config, engine=self.engine, observer=self._observe)
        log.info("replica %s ready (pid %d)", self.replica_id, os.getpid())

    # ---- what Ray calls ---------------------------------------------------------------------------
    def record_routing_stats(self) -> dict[str, Any]:
        """The report the router reads (messages.py lists its fields)."""
        report = dict(self._report)
        report.update(ready=self.async_engine.is_running and bool(report), registry=self.registry_version,
                      pid=os.getpid(), migrations=self.engine.num_migrations)
        return report

    def check_health(self) -> None:
        if not self.async_engine.is_running:
            raise RuntimeError(f"the engine stopped: {self.async_engine.error!r}")

    def __del__(self) -> None:
        engine = getattr(self, "async_engine", None)
        if engine is not None:
            engine.shutdown()

    # ---- jobs ---------------------------------------------------------------------------------------
    async def generate(self, job: Job) -> AsyncIterator[Any]:
        """Run `job`; yields this replica's id first, then each `RequestOutput` (the last one finished: stop,
        length, abort, error, or migrated)."""
        counted = False
        try:
            yield self.replica_id
            await self._ensure_adapters(job.sources)
            prompt = Resumed(job.prompt, job.resume) if job.resume else list(job.prompt)
            rid = await self.async_engine.submit(prompt, job.params, job.adapter, request_id=job.key)
            counted = True   # in the scheduler now: from the next report on, the engine's own numbers show it
            self.received[job.origin] += 1
            async with contextlib.aclosing(self.async_engine.stream(rid)) as outputs:   # leaving it aborts
                async for out in outputs:
                    yield out
        finally:
            if not counted:
                self.received[job.origin] += 1
            self.ended[job.origin] += 1

    async def control(self, call: Control) -> Any:
        """Run one of the `op_*` methods for the ingress (only on this replica: `call.target`)."""
        if call.target != self.replica_id:   # the router honours targets; a mismatch is a bug, said loudly
            raise ValueError(f"control call {call.op!r} for replica {call.target!r} reached {self.replica_id!r}")
        method = getattr(self, f"op_{call.op}", None)
        if method is None:
            raise ValueError(f"unknown control op {call.op!r}")
        return await method(call.args)

    async def describe(self) -> dict:
        """`op_describe`, from any replica (the ingress asks before it knows the replicas' ids)."""
        return await self.op_describe()

    async def op_describe(self, _: Any = None) -> dict:
        """What the ingress needs to serve the model: its config, tokenizer, limits and adapters' specs."""
        engine = self.engine
        specs = {name: engine.adapters.spec(name) for name in engine.adapters.names()}
        return {"replica": self.replica_id, "config": engine.config, "model_config": engine.model_config,
                "tokenizer": engine.tokenizer, "max_model_len": engine.max_model_len,
                "eos_token_ids": sorted(engine.eos_token_ids), "specs": specs, "initial": sorted(self.initial),
                "dtype": engine.adapters.pool.dtype}

    async def op_sync_adapters(self, args: dict) -> int:
        """Make the run-time adapters `args["adapters"]` (name → folder) and the removals `args["removed"]` this
        replica's, as of the ingress's registry version `args["version"]` (returned)."""
        async with self._sync_lock:   # one at a time, and never an older registry after a newer one
            version = int(args["version"])
            if version < self.registry_version:
                return self.registry_version
            wanted: dict[str, str] = dict(args["adapters"])
            removed = set(args["removed"]) & self.initial
            for name in sorted((set(self.registry) - set(wanted)) | (removed - self.removed)):
                await asyncio.to_thread(_unregister, self.engine, name)
                self.registry.pop(name, None)
            self.removed = removed
            await self._ensure_adapters(wanted)
            self.registry_version = version
            return version

    async def op_peers(self, free_blocks: list[int]) -> None:
        """The free KV blocks of the other replicas with a free seat (for migration decisions)."""
        self.engine.peers.set(free_blocks)

    async def op_hold_kv_blocks(self, count: int) -> int:
        """Keep `count` KV blocks out of use (ReplicaEngine.hold_kv_blocks); the number held."""
        held = await asyncio.to_thread(self.async_engine.run_on_engine,
                                       lambda engine: engine.hold_kv_blocks(count))
        self.held_blocks = held
        self._last_report = 0.0   # report the smaller budget at once
        return held

    async def op_pid(self, _: Any = None) -> int:
        return os.getpid()

    # ---- internals ----------------------------------------------------------------------------------
    async def _ensure_adapters(self, sources: dict[str, str]) -> None:
        """Register (off the event loop: it reads files) every adapter of `sources` this replica lacks."""
        for name, folder in sources.items():
            if name not in self.engine.adapters:
                try:
                    await asyncio.to_thread(self.engine.adapters.register, name, folder)
                except AdapterError as e:
                    if name not in self.engine.adapters:   # not a race with another job registering it
                        raise
                    log.debug("adapter %r registered meanwhile: %s", name, e)
                self.registry[name] = folder

    def _observe(self, engine: ReplicaEngine) -> None:
        """On the engine's thread after every step and idle tick: count the step's time (busy seconds: the engine
        ran a step), and refresh the report now and then."""
        info = engine.last_step
        if info is not None and info is not self._last_step:
            self._last_step = info
            self.busy_s += info.seconds
        now = time.monotonic()
        if now - self._last_report >= REPORT_EVERY_S:
            self._last_report = now
            # the counters with the engine's numbers they agree with: a job counted here shows in them
            try:
                counters = {"received": dict(self.received), "ended": dict(self.ended)}
            except RuntimeError:   # a new origin's key added meanwhile (on the event loop): next time
                return
            # the peers' free KV blocks as the ingress last pushed them, less this replica's bookings since
            self._report = {**engine_report(engine, self.held_blocks), **counters, "busy_s": self.busy_s,
                            "peer_free_kv_blocks": engine.peers.snapshot()}


def _register_initial(engine: ReplicaEngine, adapters: dict[str, str], packed: list[str],
                      synthetic: int) -> set[str]:
    """The adapters a replica starts with, as `loraplex serve` registers them (server/serve.py)."""
    names: set[str] = set()
    for name, folder in adapters.items():
        engine.add_adapter(name, folder)
        names.add(name)
    for path in packed:
        names.update(engine.adapters.register_packed(Path(path)))
    for i in range(synthetic):
        engine.adapters.register_synthetic(f"syn-{i}", engine.config.max_lora_rank, seed=i + 1)
        names.add(f"syn-{i}")
    engine.freeze_heap()
    return names


def _unregister(engine: ReplicaEngine, name: str) -> None:
    try:
        engine.adapters.unregister(name)
    except AdapterError as e:   # not here (never used on this replica): nothing to undo
        log.debug("unregistering %r: %s", name, e)
