"""`ServerState`: what the HTTP side knows besides the engine — the served names, requests in flight
per adapter, adapters being removed, and the bridge from the engine's thread to the metrics.

The event loop is single-threaded, so the counters here need no lock; the engine is only touched
through `AsyncEngine` (commands) and the thread-safe `AdapterCache`.
"""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..adapters import AdapterCache
from ..adapters.composition import Composition
from ..engine.async_engine import AsyncEngine
from ..engine.engine import Engine
from .metrics import EngineSnapshot, ServerMetrics
from .settings import ServerSettings
from .tenants import Access, KeyRing

log = logging.getLogger("loraplex.server")

SNAPSHOT_EVERY_S = 0.5   # how often the engine thread refreshes the gauges


@dataclass
class AdapterRecord:
    name: str
    source: str          # folder or packed file it came from
    created: int         # unix seconds
    requests_served: int = 0


@dataclass
class CompositionRecord:
    """A named composition (POST /v1/adapters {"name", "compose"}): a recipe, no weights."""
    name: str
    composition: Composition
    created: int         # unix seconds
    registering: bool = True   # until the engine has it (a delete waits for that)


@dataclass
class ServerState:
    engine: AsyncEngine
    settings: ServerSettings
    metrics: ServerMetrics
    model_name: str                                   # the base model's name in the API
    created: int = field(default_factory=lambda: int(time.time()))
    adapters: dict[str, AdapterRecord] = field(default_factory=dict)   # served now, by name
    draining: set[str] = field(default_factory=set)  # deleted, unregistered once their requests end
    compositions: dict[str, CompositionRecord] = field(default_factory=dict)   # named compositions served now
    in_flight: int = 0                                # engine requests submitted by the server, not yet ended
    in_flight_by_adapter: Counter = field(default_factory=Counter)   # by adapter: each member of a composition
    accepting: bool = True                            # False once shutdown has begun
    keyring: KeyRing | None = None                    # --api-keys: the tenants' keys

    def __post_init__(self) -> None:
        self._last_snapshot = 0.0
        self._last_step = None
        self.engine.observer = self._observe

    # ---- the engine's facts ---------------------------------------------------------------------
    @property
    def core(self) -> Engine:
        return self.engine.engine

    @property
    def cache(self) -> AdapterCache:
        return self.core.adapters

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.core.model_config.vocab_size

    @property
    def max_in_flight(self) -> int:
        """Requests running plus the bounded queue behind them; past it, new requests get 429."""
        return self.core.config.max_num_seqs + self.settings.max_waiting_requests

    def visible_adapters(self, access: Access) -> list[str]:
        """The adapters served now that `access` may use, sorted (what /v1/models lists)."""
        return [name for name in sorted(self.adapters) if name not in self.draining and access.may_use(name)]

    def register_existing(self, source_by_name: dict[str, str]) -> None:
        now = int(time.time())
        for name, source in source_by_name.items():
            self.adapters[name] = AdapterRecord(name, source, now)

    # ---- requests in flight -----------------------------------------------------------------------
    def reserve(self, adapters: str | tuple[str, ...] | None, count: int) -> None:
        """Count `count` engine requests in flight, before any await: the 429 bound and adapter
        removal both see a request from the moment it is accepted, not once it reaches the engine.
        `adapters`: the adapter, or a composition's members (each counted), or None."""
        self.in_flight += count
        for adapter in _names(adapters):
            self.in_flight_by_adapter[adapter] += count

    def release(self, adapters: str | tuple[str, ...] | None, served: bool = False) -> None:
        """One reserved engine request is over (`served`: it finished with stop or length)."""
        self.in_flight -= 1
        for adapter in _names(adapters):
            self._release_one(adapter, served)

    def _release_one(self, adapter: str, served: bool) -> None:
        self.in_flight_by_adapter[adapter] -= 1
        record = self.adapters.get(adapter)
        if record is not None and served:
            record.requests_served += 1
        if self.in_flight_by_adapter[adapter] <= 0:
            del self.in_flight_by_adapter[adapter]
            if adapter in self.draining:
                self.finish_removal(adapter)

    def finish_removal(self, name: str) -> None:
        """Unregister a deleted adapter now that none of the server's requests use it."""
        self.draining.discard(name)
        try:
            self.cache.unregister(name)
        except Exception as e:  # already gone: nothing to undo
            log.warning("unregistering adapter %r: %s", name, e)

    # ---- engine thread → metrics ----------------------------------------------------------------
    def _observe(self, engine: Engine) -> None:
        """Runs on the engine's thread after every step (and on idle ticks)."""
        info = engine.last_step
        if info is not None and info is not self._last_step:   # each step once (idle ticks see it again)
            self._last_step = info
            self.metrics.observe_step(info.num_tokens, info.num_seqs)
        now = time.monotonic()
        if now - self._last_snapshot < SNAPSHOT_EVERY_S:
            return
        self._last_snapshot = now
        self.metrics.set_engine(snapshot(engine))
        for stage, seconds in engine.adapters.take_load_times():
            self.metrics.adapter_loaded(seconds, stage)


def _names(adapters: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if adapters is None else (adapters,) if isinstance(adapters, str) else adapters


def snapshot(engine: Engine) -> EngineSnapshot:
    """The engine's state for the gauges; read on its own thread."""
    scheduler = engine.scheduler
    running = sorted({name for s in scheduler.running for name in s.adapter_names})   # each member
    waiting = sorted({name for s in scheduler.waiting for name in s.adapter_names})
    tiers = engine.adapters.counts_by_state()
    by_tier = {"gpu": tiers.get("gpu", 0), "cpu": tiers.get("cpu", 0),
               "disk": tiers.get("disk", 0) + tiers.get("reading", 0),
               "loading": tiers.get("loading", 0), "failed": tiers.get("failed", 0)}
    total = engine.blocks.num_blocks
    return EngineSnapshot(num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
                          kv_blocks_used=total - engine.blocks.num_free, kv_blocks_total=total,
                          running_adapters=running, waiting_adapters=waiting, adapters_by_tier=by_tier,
                          max_gpu_adapters=engine.config.max_gpu_adapters)


def default_model_name(model: str | Path) -> str:
    """The base model's API name: the folder's name, or the "dummy:<preset>" string."""
    text = str(model)
    if text.startswith("dummy:"):
        return text
    return Path(text).resolve().name or text
