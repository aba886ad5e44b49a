"""The engine facade the server reads at the ingress (`ClusterCore`: `state.core`), and its adapter registry
(`ClusterAdapters`: `state.cache`), standing for every replica at once.

`ClusterAdapters` answers the `AdapterCache` methods the server calls (server/adapters_api.py, generation.py):
- `register(name, folder)` validates the folder here (the server has read every weight already), then pushes the
  registry to every replica and returns once all have it; a replica Ray starts later gets it before its first
  request (view.py); each replica reads the weights on first use;
- `unregister(name)` leaves the registry at once (the server calls it once no request uses the name) and reaches
  the replicas in the background: no request is routed for that name any more;
- a tier is the best one among the replicas (gpu if any holds it in a slot, cpu if any in host memory, else disk).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..adapters import AdapterError, AdapterPool, AdapterSpec, inspect_peft_adapter
from ..adapters.spec import check_adapter_name
from ..config import EngineConfig
from ..server.metrics import TIERS
from .view import ClusterView


@dataclass(frozen=True)
class PoolLimits:
    """What the server asks of the adapter pool: the slots' rank and dtype (every replica has the same)."""
    max_rank: int
    dtype: Any

    def check_fits(self, adapter_max_rank: int, name: str) -> None:
        AdapterPool.check_fits(self, adapter_max_rank, name)   # the pool's own rule and message (names the flag)


class ClusterAdapters:
    def __init__(self, model, pool: PoolLimits, specs: dict[str, AdapterSpec], view: ClusterView) -> None:
        self.model, self.pool, self.view = model, pool, view
        # push the registry to every replica: waiting until they have it, or not (upkeep.py binds them)
        self.push: Callable[[], None] = lambda: None
        self.push_later: Callable[[], None] = lambda: None
        self._initial = set(specs)
        self._specs = dict(specs)              # every adapter served now
        self._runtime: dict[str, str] = {}     # registered at run time: name → folder
        self._removed: set[str] = set()        # initial adapters removed at run time
        self.version = 0                       # bumped by every change
        self._lock = threading.Lock()

    # ---- the registry -------------------------------------------------------------------------------
    def register(self, name: str, folder: str | Path) -> AdapterSpec:
        """Validate `folder` against the model and the slots, add it, and return once every replica has it
        (called off the event loop, as the server does)."""
        check_adapter_name(name)
        spec = inspect_peft_adapter(folder, self.model, name=name)
        self.pool.check_fits(spec.max_rank, name)
        with self._lock:
            if name in self._specs:
                raise AdapterError(f"adapter name {name!r} is already registered")
            self._specs[name] = spec
            self._runtime[name] = str(folder)
            self._removed.discard(name)
            self.version += 1
            self.view.required_version = self.version   # a replica without it is not routed to
        self.push()
        return spec

    def unregister(self, name: str) -> None:
        with self._lock:
            if name not in self._specs:
                raise AdapterError(f"unknown adapter {name!r}")
            del self._specs[name]
            if self._runtime.pop(name, None) is None:
                self._removed.add(name)
            self.version += 1
        self.push_later()

    def snapshot(self) -> dict:
        """What `sync_adapters` gives a replica (replica.py)."""
        with self._lock:
            return {"version": self.version, "adapters": dict(self._runtime), "removed": sorted(self._removed)}

    def sources(self, names: tuple[str, ...]) -> dict[str, str]:
        """The folders of those of `names` registered at run time (a job carries them: replica.py)."""
        with self._lock:
            return {n: self._runtime[n] for n in names if n in self._runtime}

    # ---- what the server reads ----------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._specs)

    def __contains__(self, name: str) -> bool:
        with self._lock:
            return name in self._specs

    def spec(self, name: str) -> AdapterSpec:
        with self._lock:
            if name not in self._specs:
                raise AdapterError(f"unknown adapter {name!r}")
            return self._specs[name]

    def tier(self, name: str) -> str:
        self.spec(name)
        reports = self.view.reports().values()
        if any(name in r.get("gpu_adapters", ()) for r in reports):
            return "gpu"
        return "cpu" if any(name in r.get("cpu_adapters", ()) for r in reports) else "disk"

    def is_resident(self, name: str) -> bool:
        return self.tier(name) == "gpu"

    def error(self, name: str) -> str | None:
        self.spec(name)
        return None   # a replica's failed load comes back as that request's error

    def retry_in(self, name: str) -> float:
        return 0.0

    def prefetch(self, name: str) -> None:
        """Nothing: each replica reads an adapter's weights on its first request there."""

    def counts_by_state(self) -> dict[str, int]:
        """Adapters by tier, summed over the replicas."""
        counts = dict.fromkeys(TIERS, 0)
        for report in self.view.reports().values():
            for tier, count in report.get("tiers", {}).items():
                counts[tier] = counts.get(tier, 0) + int(count)
        return counts

    def take_load_times(self) -> list[tuple[str, float]]:
        return []


@dataclass
class ClusterCore:
    """`state.core` at the ingress: the replicas' model, tokenizer and limits. `config` is a replica's, with
    max_num_seqs the cluster's (replicas × each one's), which bounds the requests the server keeps in flight."""
    config: EngineConfig
    model_config: Any
    tokenizer: Any
    max_model_len: int
    eos_token_ids: frozenset
    adapters: ClusterAdapters
