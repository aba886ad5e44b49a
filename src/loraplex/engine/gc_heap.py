"""The engine's long-lived heap, out of reach of Python's cyclic garbage collector.

A full (generation 2) collection walks every container object alive, and stops every thread while it
does. A serving process holds hundreds of thousands of them that live as long as it does: torch's and
transformers' modules and the model (~400,000 objects with a tiny model, on this machine), and each
registered adapter's spec (an entry per layer and projection: ~228 objects for a Llama-2-7B adapter on all
seven projections, ~230,000 for 1,000 adapters). With the engine's host work stubbed out, 1,000 queued
requests on 1,000 adapters saw four full collections of 208–218 ms each in 13 s on a 2-core machine
(benchmarks/probe_engine_host_steps.py), and the steps they fell into took as long: on the GPU, a stall of
the whole batch. What the engine allocates per step is freed by reference counting.

So the engine collects once and then freezes what is alive (`gc.freeze`: moved to a permanent
generation that collections skip) when it has started, and again when asked after registering many
adapters (`Engine.freeze_heap`). Objects frozen are still freed by reference counting; only cycles among
them that become garbage later stay (a bounded leak). vLLM, SGLang and TensorRT-LLM do the same after
start-up. `EngineConfig.freeze_gc_heap=False` turns it off; `Engine.close` unfreezes.
"""
from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("loraplex.engine")


def freeze_heap() -> int:
    """Collect, then freeze every object alive now; the number frozen in all (`gc.get_freeze_count`)."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("froze the heap: %d objects out of the collector's reach (%.0f ms)", frozen,
              1e3 * (time.perf_counter() - start))
    return frozen


def unfreeze_heap() -> None:
    """Give the frozen objects back to the collector (they join the oldest generation)."""
    gc.unfreeze()
