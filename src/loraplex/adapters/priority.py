"""The engine's host-bound work first: background adapter loads step aside while it runs.

An eager forward (a prefill or mixed step) issues ~1,500 kernel launches from Python, each giving up
and retaking the GIL. Adapter loads run on threads of the same process and make thousands of small
torch calls per adapter (read, cast, pin, copy to a slot), so while they run, the engine's thread waits
for the GIL at nearly every launch. On the H200 this made mixed steps 4× slower while adapters
streamed in (107 ms against 28 ms with every adapter resident; docs/design-notes.md).

So the engine marks such stretches `busy()`, and the loaders call `checkpoint()` between modules (the
slot copy between layers, one copy call each): while the engine is busy a checkpoint waits until it is
done, but at most `max_wait_s` each time, so that loads still progress through long runs of eager steps.
Decode steps replay CUDA graphs and leave their host time to the loaders. (Without it, on the H200: 9% less
throughput at batch 32, 3% more at unlimited batch, where loads hold the batch back.)
"""
from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class HostPriority:
    """Busy stretches of the engine (counted, from any thread) and the loaders' checkpoints."""

    def __init__(self, max_wait_s: float = 0.005) -> None:
        if not max_wait_s > 0:
            raise ValueError(f"max_wait_s must be positive, got {max_wait_s!r}")
        self.max_wait_s = max_wait_s
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        self._busy = 0

    @contextmanager
    def busy(self) -> Iterator[None]:
        """A stretch of host-bound engine work (nests, and may come from several threads)."""
        with self._lock:
            self._busy += 1
            self._idle.clear()
        try:
            yield
        finally:
            with self._lock:
                self._busy -= 1
                if self._busy == 0:
                    self._idle.set()

    @property
    def is_busy(self) -> bool:
        return not self._idle.is_set()

    def checkpoint(self) -> None:
        """Background work: let a busy engine go first (wait for it, at most `max_wait_s`)."""
        if not self._idle.is_set():
            self._idle.wait(self.max_wait_s)


HOST_PRIORITY = HostPriority()
