"""The engine's long-lived heap, out of reach of Python's cyclic garbage collector.

A full (generation 2) collection walks every container object alive, and stops every thread while it
does. A serving process holds hundreds of thousands of them that live as long as it does: torch's and
transformers' modules and the model (~400,000 objects with a tiny model, on this machine), and each
registered adapter's spec (a ModuleSpec per layer and projection, 224 for a Llama-2-7B adapter on all
seven projections: ~228 tracked objects with the spec's own, ~230,000 for 1,000 adapters). With the
engine's host work stubbed out, 1,000 queued requests on 1,000 adapters saw four full collections of up
to 208 and 218 ms in two runs of 8–9 s on a 2-core machine (docs/design-notes.md), and
the steps they fell into took as long: on the GPU, a stall of the whole batch. What the engine allocates
per step is freed by reference counting.

So the engine collects once and then freezes what is alive (`gc.freeze`: moved to a permanent
generation that collections skip) when it has started, and again when asked after registering many
adapters (`Engine.freeze_heap`; the bench and `loraplex serve` do, after registering theirs). Frozen
objects are still freed by reference counting (an `LLM` dropped without `close()` still gives its engine
and KV cache back: checked); only cycles among them that become garbage later stay, until the last
engine that froze is closed and the heap is unfrozen. vLLM, SGLang and TensorRT-LLM freeze their heaps
after start-up too. `EngineConfig.freeze_gc_heap=False` turns it off.
"""
from __future__ import annotations

import gc
import logging
import threading
import time

log = logging.getLogger("loraplex.engine")


_holders = 0   # engines that froze the heap and are not closed yet
_lock = threading.Lock()


def freeze_heap(first: bool) -> int:
    """Collect, then freeze every object alive now; the number frozen in all (`gc.get_freeze_count`).
    `first`: the caller starts holding the freeze (see `release_heap`)."""
    global _holders
    with _lock:
        _holders += int(first)
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze the heap: %d objects out of the collector's reach (%.0f ms)", frozen,
              1e3 * (time.perf_counter() - start))
    return frozen


def release_heap() -> None:
    """An engine that froze is done: once no engine holds the freeze any more, the frozen objects go back
    to the collector (they join the oldest generation), so that cycles among them can be collected."""
    global _holders
    with _lock:
        _holders = max(_holders - 1, 0)
        if _holders == 0:
            gc.unfreeze()
