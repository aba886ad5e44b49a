"""The scheduler's side of the adapter cache: pin a request's adapter slots, all of them or none, and tell
the cache which adapters the waiting queue needs next.

Every running request pins its adapters' slots until it ends or is preempted, so the distinct adapters in a
step never exceed the GPU slots. A request that combines several adapters (adapters/composition.py) runs only
with all of them on the GPU, so it pins all of them or none.
"""
from __future__ import annotations

from ..adapters import AdapterCache, AdapterError
from ..config import EngineConfig
from .sequence import Sequence

PLAN_SCAN = 4096   # waiting requests looked at per step for adapters to load (queue order)


def pin_adapters(adapters: AdapterCache, names: tuple[str, ...]) -> tuple[int, ...] | None:
    """Pin the slots of all of `names` (() for the base model), or none: None while one is not on the GPU
    yet. Raises AdapterError (naming the adapter) if one failed to load or is gone, pinning nothing."""
    slots: list[int] = []
    try:
        for name in names:
            slot = adapters.acquire_if_resident(name)
            if slot is None:
                break
            slots.append(slot)
        else:
            return tuple(slots)
    except AdapterError:
        unpin_adapters(adapters, names[:len(slots)])
        raise
    unpin_adapters(adapters, names[:len(slots)])
    return None


def unpin_adapters(adapters: AdapterCache, names: tuple[str, ...]) -> None:
    for name in names:
        adapters.release(name)


def want_adapters(adapters: AdapterCache, waiting: list[Sequence], running: list[Sequence],
                  config: EngineConfig) -> None:
    """Tell the adapter cache what the waiting requests need, in queue order (every adapter of a
    request that combines several): on the GPU, as many as the slots the running requests leave
    free; on the host (read ahead from disk), those of the requests after them, as many as the CPU
    tier holds.

    Wanting more than the free slots would make the later requests' loads evict the adapters of
    the earlier ones (least recently used) before those are admitted: under many distinct
    adapters the queue's head would then never find its adapter resident.
    """
    if not waiting:
        adapters.want([], 0)
        return
    pinned = {name for seq in running for name in seq.adapter_names}
    free = max(config.max_gpu_adapters - len(pinned), 0)
    # every host copy lands in the CPU tier: wishes and read-ahead together must fit in it, or the
    # read-ahead would evict its own copies before they are used (the cache caps it so)
    ahead = max(free, config.max_cpu_adapters)
    names: dict[str, None] = {}
    for i, seq in enumerate(waiting):
        if len(names) >= ahead or i >= PLAN_SCAN:
            break
        for name in seq.adapter_names:
            if name not in pinned:
                names[name] = None
    adapters.want(list(names), free)
