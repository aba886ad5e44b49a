"""`ClusterOptions`: the application's arguments (`build_app(args)`, a Serve config file's `args:`, or
`loraplex serve --replicas`), checked before anything starts; errors name the argument."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from .routing import Policy

DEMO_MODEL_NAME = "loraplex-demo"


@dataclass
class ClusterOptions:
    engine: dict = field(default_factory=dict)       # EngineConfig's fields, for every replica (no model: the demo)
    server: dict = field(default_factory=dict)       # ServerSettings' fields, for the ingress
    adapters: dict = field(default_factory=dict)     # name → PEFT folder, registered on every replica
    packed: list = field(default_factory=list)       # packed adapter files, registered on every replica
    replicas: int = 1                                # engine replicas (one per GPU)
    gpus_per_replica: float | None = None            # default: 1 when the Ray cluster has GPUs, else 0 (CPU)
    cpus_per_replica: float = 1.0
    router_queue: int = 64                           # requests that may wait at the router for room; then 429
    policy: str = Policy.CONSOLIDATE.value           # consolidate, least_loaded or round_robin (routing.py)
    target_batch: int | None = None                  # consolidate: spread once batches reach it (routing.py)
    migration: bool = True                           # move requests off a replica short of KV memory
    max_retries: int = 3                             # replicas a request may lose (failover) before it fails
    stats_period_s: float = 0.25                     # how often Ray collects each replica's report

    def __post_init__(self) -> None:
        for name, kind in (("engine", dict), ("server", dict), ("adapters", dict), ("packed", list)):
            if not isinstance(getattr(self, name), kind):
                raise ValueError(f"{name} must be a {kind.__name__}, got {getattr(self, name)!r}")
        for name, minimum in (("replicas", 1), ("router_queue", 0), ("max_retries", 0), ("target_batch", 1)):
            value = getattr(self, name)
            if value is None and name == "target_batch":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
        for name in ("gpus_per_replica", "cpus_per_replica", "stats_period_s"):
            value = getattr(self, name)
            if value is None and name == "gpus_per_replica":
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.stats_period_s <= 0:
            raise ValueError(f"stats_period_s must be > 0, got {self.stats_period_s!r}")
        try:
            Policy(self.policy)
        except ValueError:
            raise ValueError(f"policy must be one of {[p.value for p in Policy]}, got {self.policy!r}") from None
        if not isinstance(self.migration, bool):
            raise ValueError(f"migration must be a bool, got {self.migration!r}")
        self.adapters = {str(k): str(v) for k, v in self.adapters.items()}
        self.packed = [str(p) for p in self.packed]

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> "ClusterOptions":
        """From a Serve `args` dict; an unknown key is an error that lists the known ones. No `engine.model`: the
        demo model shipped with loraplex, with its adapters."""
        args = dict(args or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - known)
        if unknown:
            raise ValueError(f"unknown argument(s) {unknown}; known: {sorted(known)}")
        options = cls(**{name: _from_text(name, value) for name, value in args.items()})
        if "model" not in options.engine:
            from ..demo.assets import demo_adapters, demo_model_dir
            options.engine = dict(options.engine, model=str(demo_model_dir()))
            options.adapters = {**{k: str(v) for k, v in demo_adapters().items()}, **options.adapters}
            options.server = {"served_model_name": DEMO_MODEL_NAME, **options.server}
        return options

    def check(self) -> None:
        """Build the engine's and the server's settings once, here, so a bad value fails before Ray starts."""
        from ..config import EngineConfig
        from ..server.settings import ServerSettings
        EngineConfig.from_kwargs(**self.engine)
        ServerSettings(**self.server)

    def to_args(self) -> dict[str, Any]:
        return asdict(self)


_NUMBERS = {"replicas": int, "router_queue": int, "max_retries": int, "target_batch": int, "gpus_per_replica": float,
            "cpus_per_replica": float, "stats_period_s": float}


def _from_text(name: str, value: Any) -> Any:
    """`serve run ... replicas=2` passes every argument as text: numbers and booleans are read from it."""
    if not isinstance(value, str):
        return value
    if name in _NUMBERS:
        try:
            return _NUMBERS[name](value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}") from None
    if name == "migration" and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    return value
