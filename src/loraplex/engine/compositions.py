"""A request's adapters as the engine takes them: a name, a {name: weight} mapping, or a named composition.

`NamedCompositions` holds the compositions registered under a name (recipes: no weights are copied) and turns what
a request gives as its `adapter` into a `Composition` (adapters/composition.py) the scheduler can pin, checking it
against the registered adapters and the engine's limits: at most `max_adapters_per_request` members (1 refuses
every composition and weight), and no more than the GPU slots, since a request pins all of its members at once and
one that needs more slots than there are would never run.
"""
from __future__ import annotations

import threading

from ..adapters import AdapterCache, AdapterError
from ..adapters.composition import AdapterRef, Composition
from ..adapters.spec import check_adapter_name
from ..config import EngineConfig


class NamedCompositions:
    """The engine's named compositions, and the checks of a request's adapters. Changes hold a lock (the cluster's
    engine makes them from the server's worker threads); the mapping is replaced, never changed in place, so
    `snapshot` and `resolve` read it from any thread without one."""

    def __init__(self, config: EngineConfig, adapters: AdapterCache) -> None:
        self.config, self.adapters = config, adapters
        self._named: dict[str, Composition] = {}
        self._lock = threading.Lock()

    def __contains__(self, name: str) -> bool:
        return name in self._named

    def snapshot(self) -> dict[str, Composition]:
        return dict(self._named)

    def using(self, adapter: str) -> list[str]:
        """The named compositions that have `adapter` as a member."""
        return [name for name, comp in self._named.items() if adapter in comp.names]

    def add(self, name: str, composition: Composition) -> None:
        check_adapter_name(name)
        if name in self._named or name in self.adapters:
            raise AdapterError(f"adapter name {name!r} is already registered")
        if not isinstance(composition, Composition) or not composition.members:
            raise ValueError(f"composition {name!r} must be a Composition of at least one adapter, "
                             f"got {composition!r}")
        self.check(composition, f"composition {name!r}")
        with self._lock:
            if name in self._named:
                raise AdapterError(f"adapter name {name!r} is already registered")
            self._named = {**self._named, name: composition}

    def remove(self, name: str) -> None:
        with self._lock:
            if name not in self._named:
                raise AdapterError(f"unknown composition {name!r}")
            self._named = {k: v for k, v in self._named.items() if k != name}

    def resolve(self, adapter: AdapterRef) -> tuple[Composition | None, str | None]:
        """(the composition, what the request called it) for an adapter's or a named composition's name, a
        {name: weight} mapping or a Composition (called by its string form); (None, None) for the base model.
        ValueError for a malformed value (`Composition.parse`) or one beyond the engine's limits; AdapterError for
        an unknown member or one that failed to load, naming it."""
        if isinstance(adapter, str) and adapter in self._named:   # its members may have failed since
            composition, label = self._named[adapter], adapter
        else:
            composition = Composition.parse(adapter, "adapter")
            if composition is None:
                return None, None
            label = adapter if isinstance(adapter, str) else str(composition)
        self.check(composition, "adapter")
        return composition, label

    def check(self, composition: Composition, field: str) -> None:
        """Its members are registered adapters that have not failed, within this engine's limits. Errors name
        `field`, and the member at fault (`field['name']: ...`) unless the request names one adapter alone."""
        names, limit = composition.names, self.config.max_adapters_per_request
        alone = field == "adapter" and composition.single is not None   # today's messages for a plain name
        if composition.single is None and limit == 1:
            raise ValueError(f"{field}: this engine serves one adapter per request at weight 1 "
                             f"(max_adapters_per_request=1); got {composition}")
        if len(names) > limit:
            raise ValueError(f"{field} combines {len(names)} adapters; this engine takes at most {limit} "
                             f"(max_adapters_per_request)")
        if len(names) > self.config.max_gpu_adapters:
            raise ValueError(f"{field} combines {len(names)} adapters, more than the engine's "
                             f"{self.config.max_gpu_adapters} GPU adapter slots (max_gpu_adapters): it could never run")
        for name in names:
            where = "" if alone else f"{field}[{name!r}]: "
            if name in self._named:
                raise AdapterError(f"{where}{name!r} is a composition; compositions combine adapters")
            if name not in self.adapters:
                known = ", ".join(self.adapters.names()[:20]) or "none"
                raise AdapterError(f"{where}unknown adapter {name!r} (registered: {known})")
            error = self.adapters.error(name)
            if error is not None:
                raise AdapterError(f"{where}adapter {name!r} failed to load: {error}")
