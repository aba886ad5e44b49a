"""How adapters move between the tiers (disk → host copy → GPU slot): the internals of AdapterCache.

`AdapterLoads` holds the machinery that cache.py's public methods drive: reads on loader threads,
copies into slots on the copier thread and a side stream, slot eviction, the queue of host copies
waiting for a slot, and the bookkeeping of reads in flight. Every method runs with the cache's lock
held, unless it says otherwise; the state lives on the cache (set up in AdapterCache.__init__).

A read or copy that fails marks the adapter failed (requests for it are refused with its error)
for a back-off: RETRY_BASE_S after the first failure, doubling with each failure in a row up to
RETRY_MAX_S. Once it has passed, the next look at the adapter clears the error, so the next request
reads it again: files that vanished or broke and came back serve again, with no re-registration.
"""
from __future__ import annotations

import enum
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

import torch

from .spec import AdapterError, AdapterSpec, LoraAdapter

log = logging.getLogger("loraplex.adapters")

Reader = Callable[[torch.dtype, bool], LoraAdapter]

RETRY_BASE_S = 1.0    # back-off after an adapter's first failed load
RETRY_MAX_S = 60.0    # the longest back-off (failures in a row double it)


class AdapterState(str, enum.Enum):
    DISK = "disk"        # registered; weights only on disk
    READING = "reading"  # being read from disk
    CPU = "cpu"          # a host copy is ready
    LOADING = "loading"  # being copied into a GPU slot
    GPU = "gpu"          # in a GPU slot, usable
    FAILED = "failed"    # its read failed; see error()


@dataclass
class _Entry:
    name: str
    spec: AdapterSpec
    read: Reader
    pins: int = 0
    slot: int | None = None
    ready_event: object | None = None     # set once the copy into `slot` is queued; ready when it completes
    gpu_ready: bool = False
    staged: LoraAdapter | None = None     # host copy kept for a GPU load (CPU tier or waiting for a slot)
    reading: Future | None = None
    requested: bool = False               # prefetch() asked for it on the GPU (until it gets a slot)
    read_ahead: bool = False              # its read in flight is a read-ahead (on the read-ahead thread)
    error: str | None = None
    failures: int = 0                     # failed loads in a row (reset by a read that succeeds)
    retry_at: float = 0.0                 # time.monotonic() from which a failed load is tried again
    removed: bool = False                 # unregistered while pinned: goes when the last pin does
    gpu_load_start: float = 0.0           # time.monotonic() when its slot was assigned
    staged_at: float = 0.0                # time.monotonic() when its host copy started waiting for a slot


class AdapterLoads:
    """The tier machinery AdapterCache inherits (see the module docstring)."""

    retry_base_s = RETRY_BASE_S
    retry_max_s = RETRY_MAX_S

    def _get(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None or entry.removed:
            raise AdapterError(f"unknown adapter {name!r}")
        self._retry_if_due(entry)
        return entry

    def _usable(self, name: str) -> bool:
        entry = self._entries.get(name)
        if entry is not None:
            self._retry_if_due(entry)
        return entry is not None and not entry.removed and entry.error is None

    def _fail(self, entry: _Entry, error: str) -> None:
        """Its load failed: refused until its back-off has passed (module docstring)."""
        entry.error, entry.requested = error, False
        entry.failures += 1
        entry.retry_at = time.monotonic() + min(self.retry_base_s * 2 ** (entry.failures - 1), self.retry_max_s)
        self.counters["failures"] += 1

    def _retry_if_due(self, entry: _Entry) -> None:
        if entry.error is not None and time.monotonic() >= entry.retry_at:
            log.info("adapter %r: trying its load again (failure %d was: %s)", entry.name, entry.failures, entry.error)
            entry.error = None

    def _wants_gpu(self, entry: _Entry) -> bool:
        return entry.requested or entry.name in self._wanted

    def _move_up(self, entry: _Entry, serve: bool = True, may_read: bool = True) -> bool:
        """One step towards a GPU slot: touch it if it has one, else read it or queue its host copy.
        False if it needed a read that the host-memory limit (or `may_read`) held back."""
        if entry.slot is not None:
            if entry.name in self._gpu_lru:
                self._gpu_lru.move_to_end(entry.name)
            return True
        if entry.staged is None:
            if entry.reading is None:
                if may_read and self._staged_outside_cpu_tier() < self._max_staged:
                    self._deferred.pop(entry.name, None)
                    self._start_read(entry)
                    return True
                if entry.requested:
                    self._deferred[entry.name] = entry   # started when a read finishes
                return False
            return True
        if entry.name in self._cpu_lru:
            self._cpu_lru.move_to_end(entry.name)
        if entry.name not in self._waiting:
            entry.staged_at = time.monotonic()
            self._waiting[entry.name] = entry
        if serve:
            self._serve_waiting()
        return True

    def _poll(self, entry: _Entry) -> bool:
        if entry.slot is None or entry.ready_event is None:
            return False
        if not entry.gpu_ready and (not self._cuda or entry.ready_event.query()):
            entry.gpu_ready = True
            self._load_times.append(("gpu", time.monotonic() - entry.gpu_load_start))
            if entry.pins == 0 and not entry.removed:
                self._gpu_lru[entry.name] = None
            if entry.name not in self._cpu_lru:
                entry.staged = None  # the host copy was only kept for this load
        return entry.gpu_ready

    def _poll_slots(self) -> None:
        """Loads that finished since anyone asked become ready (and evictable, if unpinned) now."""
        for owner in self._slot_owner:
            if owner is not None:
                self._poll(owner)

    def _start_read(self, entry: _Entry, ahead: bool = False) -> None:
        entry.read_ahead = ahead
        entry.reading = (self._ahead_executor if ahead else self._executor).submit(self._read, entry)
        self._reading[entry.name] = entry

    def _forget_read(self, entry: _Entry) -> None:
        entry.reading, entry.read_ahead = None, False
        if self._reading.get(entry.name) is entry:
            del self._reading[entry.name]

    def _start_deferred(self) -> None:
        """Start the reads that prefetch() could not start for the host-memory limit, oldest first."""
        while self._deferred and self._staged_outside_cpu_tier() < self._max_staged:
            _, entry = self._deferred.popitem(last=False)
            if self._entries.get(entry.name) is entry and entry.requested and entry.error is None:
                self._move_up(entry)

    def _staged_outside_cpu_tier(self) -> int:
        """Host copies held for the GPU outside the CPU tier, reads for the GPU included: those in
        flight, those waiting for a slot, and those whose copy into a slot has not finished."""
        self._poll_slots()
        outside = lambda e: e.staged is not None and e.name not in self._cpu_lru  # noqa: E731
        return (sum(1 for e in self._reading.values() if self._wants_gpu(e))
                + sum(1 for e in self._waiting.values() if outside(e))
                + sum(1 for e in self._slot_owner if e is not None and outside(e) and e.name not in self._waiting))

    def _take_slot(self) -> int | None:
        for slot, owner in enumerate(self._slot_owner):
            if owner is None:
                return slot
        self._poll_slots()
        victim = next((self._entries[n] for n in self._gpu_lru if n not in self._wanted), None)
        if victim is None:
            return None  # every slot is pinned, still loading or wanted next
        self._gpu_lru.pop(victim.name)
        slot = victim.slot
        victim.slot, victim.gpu_ready, victim.ready_event = None, False, None
        self._slot_owner[slot] = None
        self.counters["gpu_evictions"] += 1
        return slot

    def _serve_waiting(self) -> None:
        """Give slots to waiting host copies, oldest first, while slots can be had (free or evictable).

        Runs whenever a slot may have become available, so a load never waits for its own prefetch
        to be repeated, and an abandoned one still leaves (into a slot, then out by LRU).
        """
        while self._waiting:
            slot = self._take_slot()
            if slot is None:
                return
            _, entry = self._waiting.popitem(last=False)
            self._assign(entry, slot)
            # queueing hundreds of copies takes milliseconds: not on the caller's (the engine's) thread
            self._copier.submit(self._copy_to_slot, entry, slot, entry.staged)

    def _assign(self, entry: _Entry, slot: int) -> None:
        entry.slot, entry.gpu_ready, entry.ready_event = slot, False, None
        entry.gpu_load_start = time.monotonic()
        if entry.staged_at:
            self._load_times.append(("slot_wait", entry.gpu_load_start - entry.staged_at))
            entry.staged_at = 0.0
        self._slot_owner[slot] = entry
        entry.requested = False

    def _copy_to_slot(self, entry: _Entry, slot: int, host: LoraAdapter) -> None:
        """Queue the copy outside the lock (hundreds of small copies); the slot is reserved meanwhile."""
        start = time.monotonic()
        try:
            if self._cuda:
                with torch.cuda.stream(self._stream):
                    with self._lock:
                        uses, self._last_use[slot] = self._last_use[slot], {}
                    for use in uses.values():
                        self._stream.wait_event(use)
                    self.pool.write(slot, host, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(self._stream)
            else:
                self.pool.write(slot, host)
                event = True
        except Exception as e:  # e.g. out of memory for a staging copy: fail this adapter, keep the slot
            with self._lock:
                entry.slot, entry.requested = None, False
                if entry.name not in self._cpu_lru:
                    entry.staged = None
                self._release_slot(slot)
                self._fail(entry, f"copy into GPU slot {slot} failed: {type(e).__name__}: {e}")
                log.error("adapter %r: %s", entry.name, entry.error)
                self._serve_waiting()
                self._changed.notify_all()
            return
        with self._lock:
            entry.ready_event = event
            self._load_times.append(("copy_issue", time.monotonic() - start))
            self.counters["gpu_loads"] += 1
            if self._entries.get(entry.name) is not entry:  # unregistered meanwhile: free the slot
                self._release_slot(slot)
                self._serve_waiting()
            self._start_deferred()
            self._changed.notify_all()

    def _read(self, entry: _Entry) -> None:
        """Runs on a loader thread: read from disk without the lock, then file the result."""
        start = time.monotonic()
        try:
            host, error = entry.read(self.pool.dtype, self._cuda), None
        except Exception as e:  # an adapter that breaks on disk must not take anything else down
            host, error = None, str(e) if isinstance(e, AdapterError) else f"{type(e).__name__}: {e}"
        with self._lock:
            self._forget_read(entry)
            self.counters["disk_reads"] += 1
            if error is None:
                self._load_times.append(("disk", time.monotonic() - start))
            if self._entries.get(entry.name) is not entry:
                self._start_deferred()
                return
            if error is not None:
                self._fail(entry, error)
                log.error("adapter %r failed to load: %s", entry.name, error)
                self._start_deferred()
                self._changed.notify_all()
                return
            entry.failures = 0
            entry.staged = host if self._wants_gpu(entry) else None
            if self.max_cpu_adapters:
                entry.staged = host
                self._cpu_lru[entry.name] = host
                while len(self._cpu_lru) > self.max_cpu_adapters:
                    old_name, _ = self._cpu_lru.popitem(last=False)
                    old = self._entries.get(old_name)
                    if old is not None and old is not entry and old.name not in self._waiting:
                        old.staged = None  # a copy already queued for a GPU slot keeps its own reference
                    self.counters["cpu_evictions"] += 1
            if self._wants_gpu(entry):
                if entry.name not in self._waiting:
                    entry.staged_at = time.monotonic()
                self._waiting[entry.name] = entry
                self._serve_waiting()
            self._start_deferred()
            self._changed.notify_all()

    def _release_slot(self, slot: int) -> None:
        self._slot_owner[slot] = None  # no batch can name an unowned slot, so its contents don't matter

    def _drop(self, entry: _Entry) -> None:
        self._entries.pop(entry.name, None)
        self._gpu_lru.pop(entry.name, None)
        self._cpu_lru.pop(entry.name, None)
        self._waiting.pop(entry.name, None)
        if entry.reading is not None:
            entry.reading.cancel()
            self._forget_read(entry)
        self._deferred.pop(entry.name, None)
        if entry.slot is not None and entry.ready_event is not None:
            self._release_slot(entry.slot)
        entry.slot, entry.staged = None, None
        self._serve_waiting()
        self._changed.notify_all()
