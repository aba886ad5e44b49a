"""The adapter registry and its tiers: GPU slots ← pinned CPU copies ← disk.

What the scheduler uses, from any thread:

    cache.acquire_if_resident(name)  # the slot, pinned, if the adapter is on the GPU; else None
    cache.release(name)              # a request using it finished (each acquire needs one release)
    cache.want(names, num_gpu)       # its wishes: the first num_gpu on the GPU next, the rest on the host
    cache.is_resident(name)          # on the GPU and its copy finished

and, for tools and the server: `prefetch(name)` (start moving it up, without waiting) and
`try_acquire(name)` (acquire, or else prefetch and return None).

Reads from disk run on a small thread pool; host→device copies run on a side stream, and a slot
counts as resident only once its copy has finished, so a load never stalls the running batch.
GPU slots and CPU copies are each evicted least-recently-used first; a slot pinned by a running
request is never evicted or overwritten, and one the scheduler wants next is not evicted either
(its request is about to be admitted). An adapter whose read fails is marked failed, and
acquiring it raises its error, for a back-off (1 s, doubling with each failure in a row up to
60 s; loads.py); then the next request reads it again, so files that come back serve again.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import torch

from ..models.config import ModelConfig
from .loads import AdapterLoads, AdapterState, Reader, _Entry
from .packed import PackedFile
from .peft_format import inspect_peft_adapter, read_peft_adapter
from .pinned_reserve import full_adapter_chunks, reserve_count, reserve_pinned
from .pool import AdapterPool
from .spec import AdapterError, AdapterSpec, LoraAdapter, check_adapter_name
from .synthetic import read_synthetic, synthetic_spec
from .threads import one_core_per_thread

__all__ = ["AdapterCache", "AdapterState"]

log = logging.getLogger("loraplex.adapters")


class AdapterCache(AdapterLoads):
    def __init__(self, model: ModelConfig, *, max_gpu_adapters: int, max_lora_rank: int, max_cpu_adapters: int,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cuda",
                 loader_threads: int = 2) -> None:
        if not isinstance(max_cpu_adapters, int) or max_cpu_adapters < 0:
            raise ValueError(f"max_cpu_adapters must be a non-negative integer, got {max_cpu_adapters!r}")
        if not isinstance(loader_threads, int) or loader_threads <= 0:
            raise ValueError(f"loader_threads must be a positive integer, got {loader_threads!r}")
        self.model = model
        self.pool = AdapterPool(model, max_gpu_adapters, max_lora_rank, dtype, device)
        self.max_cpu_adapters = max_cpu_adapters
        self.loader_threads = loader_threads
        self._cuda = self.pool.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.pool.device) if self._cuda else None
        if self._cuda:  # the pool's allocation is queued on the current stream; copies must follow it
            self._stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        self._entries: dict[str, _Entry] = {}
        # the entry (not the name: a name can be re-registered while its old copy is in flight)
        self._slot_owner: list[_Entry | None] = [None] * max_gpu_adapters
        # per slot, each stream's latest release event since the slot's last load (by the stream's handle: a later
        # event on a stream covers its earlier ones, so a resident adapter's releases do not pile up events)
        self._last_use: list[dict[int, torch.cuda.Event]] = [{} for _ in range(max_gpu_adapters)]
        self._gpu_lru: OrderedDict[str, None] = OrderedDict()  # resident, ready and unpinned; oldest first
        self._cpu_lru: OrderedDict[str, LoraAdapter] = OrderedDict()
        # host copies ready for the GPU but without a slot, oldest wish first: served whenever a slot frees
        self._waiting: OrderedDict[str, _Entry] = OrderedDict()
        # the scheduler's latest wishes (want): adapters of the next requests to admit, first first
        self._wanted: dict[str, None] = {}
        # each on one core (threads.py: an OpenMP team per loader thread made loads crawl beside the engine)
        self._executor = ThreadPoolExecutor(loader_threads, thread_name_prefix="loraplex-adapter-read",
                                            initializer=one_core_per_thread)
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="loraplex-adapter-copy",
                                          initializer=one_core_per_thread)
        # read-ahead on its own thread, so reads for the GPU never queue behind it
        self._ahead_executor = ThreadPoolExecutor(1, thread_name_prefix="loraplex-adapter-read-ahead",
                                                  initializer=one_core_per_thread)
        self._reading: dict[str, _Entry] = {}                 # reads in flight
        self._deferred: OrderedDict[str, _Entry] = OrderedDict()  # prefetch()ed, read not yet started
        # Reads started for loads still waiting on a GPU slot hold host memory outside the CPU tier;
        # at most this many at once, so prefetching a long queue cannot exhaust host memory.
        self._max_staged = max(max_gpu_adapters, loader_threads)
        # (stage "disk" | "gpu", seconds) of recent loads, for metrics; `take_load_times` empties it
        self._load_times: deque[tuple[str, float]] = deque(maxlen=4096)
        self.counters = {"disk_reads": 0, "gpu_loads": 0, "gpu_evictions": 0, "cpu_evictions": 0, "failures": 0}
        log.info(self.pool.describe())

    def reserve_host_memory(self, max_gib: float | None = None) -> int:
        """Page-lock now the pinned host memory that the CPU tier and the reads in flight will hold, at most
        `max_gib` GiB (None: the default bound; pinned_reserve.py); the bytes reserved (0 off CUDA)."""
        count = reserve_count(self.model, self.pool.max_rank, self.pool.dtype,
                              self.max_cpu_adapters + self.loader_threads, max_gib)
        if not self._cuda:
            return 0
        return reserve_pinned(full_adapter_chunks(self.model, self.pool.max_rank, self.pool.dtype), count,
                              self.pool.dtype)

    # ---- registry -------------------------------------------------------------------------------
    def register(self, name: str, folder: str | Path) -> AdapterSpec:
        """Validate a PEFT folder against the served model and the pool (headers only) and add it."""
        self._check_new_name(name)
        spec = inspect_peft_adapter(folder, self.model, name=name)
        self.pool.check_fits(spec.max_rank, name)   # its error names the flag that raises the limit
        self._add(name, spec, partial(read_peft_adapter, spec))
        return spec

    def register_synthetic(self, name: str, rank: int, *, seed: int = 0, alpha: float | None = None) -> AdapterSpec:
        """Add a random adapter of `rank` on every projection (no files; for benchmarks and demos)."""
        self._check_new_name(name)
        spec = synthetic_spec(name, self.model, rank, alpha=alpha, seed=seed)
        self.pool.check_fits(spec.max_rank, name)
        self._add(name, spec, partial(read_synthetic, spec))
        return spec

    def register_packed(self, path: str | Path) -> list[str]:
        """Register every adapter of a packed file (see packed.py) at once; all or none."""
        packed = PackedFile(path, self.model)
        with self._lock:  # (PackedFile refuses duplicate names within the file)
            for spec in packed.specs:
                self._check_new_name(spec.name)
                self.pool.check_fits(spec.max_rank, spec.name)
            for spec in packed.specs:
                self._entries[spec.name] = _Entry(spec.name, spec, partial(packed.read, spec.locator))
        log.info("registered %d adapters from %s", len(packed.specs), packed.path)
        return [s.name for s in packed.specs]

    def _check_new_name(self, name: str) -> None:
        check_adapter_name(name)
        with self._lock:
            if name in self._entries:
                if self._entries[name].removed:
                    raise AdapterError(f"adapter name {name!r} is still being unregistered: requests still use it; "
                                       f"register it again once they finish")
                raise AdapterError(f"adapter name {name!r} is already registered")

    def _add(self, name: str, spec: AdapterSpec, read: Reader) -> None:
        with self._lock:
            self._check_new_name(name)
            self._entries[name] = _Entry(name, spec, read)

    def unregister(self, name: str) -> None:
        """Forget an adapter; if requests still use it, that happens when the last one releases it."""
        with self._lock:
            entry = self._get(name)
            if entry.pins:
                entry.removed = True
            else:
                self._drop(entry)

    def names(self) -> list[str]:
        with self._lock:
            return [n for n, e in self._entries.items() if not e.removed]

    def __contains__(self, name: str) -> bool:
        with self._lock:
            entry = self._entries.get(name)
            return entry is not None and not entry.removed

    def spec(self, name: str) -> AdapterSpec:
        with self._lock:
            return self._get(name).spec

    def state(self, name: str) -> AdapterState:
        with self._lock:
            return self._state(self._get(name))

    def tier(self, name: str) -> str:
        """Where the adapter's weights are, as the server reports it: its state's value, except that a pool
        slot is named after the pool's device: "gpu" on a GPU, "cpu" on a CPU (where host copies are too)."""
        state = self.state(name)
        if state is AdapterState.GPU and not self._cuda:
            return self.pool.device.type
        return state.value

    def _state(self, entry: _Entry) -> AdapterState:
        self._poll(entry)
        if entry.error is not None:
            return AdapterState.FAILED
        if entry.slot is not None:
            return AdapterState.GPU if entry.gpu_ready else AdapterState.LOADING
        if entry.staged is not None:
            return AdapterState.CPU
        return AdapterState.READING if entry.reading is not None else AdapterState.DISK

    def error(self, name: str) -> str | None:
        with self._lock:
            return self._get(name).error

    def retry_in(self, name: str) -> float:
        """Seconds until a failed adapter's load is tried again (0 if it has not failed)."""
        with self._lock:
            entry = self._get(name)
            return max(entry.retry_at - time.monotonic(), 0.0) if entry.error is not None else 0.0

    # ---- what the scheduler calls -----------------------------------------------------------------
    def is_resident(self, name: str) -> bool:
        with self._lock:
            entry = self._get(name)
            return self._poll(entry)

    def acquire(self, name: str) -> int:
        """Pin a resident adapter for one request and return its slot; raises if it is not resident."""
        with self._lock:
            entry = self._get(name)
            if entry.error is not None:
                raise AdapterError(f"adapter {name!r} failed to load: {entry.error}")
            if not self._poll(entry):
                raise AdapterError(f"adapter {name!r} is not on the GPU yet (state {self.state(name).value})")
            entry.pins += 1
            self._gpu_lru.pop(name, None)
            return entry.slot

    def acquire_if_resident(self, name: str) -> int | None:
        """`acquire` if resident, else None (starting nothing: loads are for `want` to order)."""
        with self._lock:
            entry = self._get(name)
            if entry.error is not None:
                raise AdapterError(f"adapter {name!r} failed to load: {entry.error}")
            return self.acquire(name) if self._poll(entry) else None

    def try_acquire(self, name: str) -> int | None:
        """`acquire` if resident; otherwise start moving it up (as `prefetch`) and return None."""
        with self._lock:
            entry = self._get(name)
            if entry.error is None and self._poll(entry):
                return self.acquire(name)
        self.prefetch(name)
        return None

    def release(self, name: str) -> None:
        """Unpin one use. Call it after queueing the last kernel that reads the slot, on that stream:
        the slot is overwritten only after the work queued there so far has finished."""
        with self._lock:
            entry = self._entries.get(name)
            if entry is None or entry.pins <= 0:
                raise AdapterError(f"release({name!r}) without a matching acquire")
            entry.pins -= 1
            if self._cuda:  # the slot may be overwritten only after the work queued so far has used it
                stream = torch.cuda.current_stream(self.pool.device)
                event = torch.cuda.Event()
                event.record(stream)
                self._last_use[entry.slot][stream.cuda_stream] = event   # users may be on several streams
            if entry.pins:
                return
            if entry.removed:
                self._drop(entry)
            else:
                self._gpu_lru[name] = None
                self._serve_waiting()
            self._start_deferred()
            self._changed.notify_all()

    def prefetch(self, name: str) -> None:
        """Start moving an adapter towards the GPU; returns at once. Call again if no slot was free."""
        with self._lock:
            entry = self._get(name)
            if entry.error is not None:
                raise AdapterError(f"adapter {name!r} failed to load: {entry.error}")
            if entry.slot is None:
                entry.requested = True
            self._move_up(entry)

    def want(self, names: list[str], num_gpu: int) -> None:
        """The scheduler's wishes, replacing its last ones; returns at once.

        `names`: the adapters of the waiting requests in queue order. The first `num_gpu` usable ones
        (the slots that running requests leave free) move towards a GPU slot, ahead of any other
        load, and one already there is not evicted while wanted. An adapter wanted before and not
        now stops waiting for a slot (its request went, or others come first now): loads are never
        made for requests that will not run soon, so the adapters of the queue's head are not
        evicted by those of requests behind it. The names after those are read ahead from disk into
        the CPU tier (as many as it holds beside the wanted ones), so that their GPU loads start
        from host memory. Unknown and failed names are skipped (the scheduler fails their requests).
        """
        with self._lock:
            # loads that finished become ready now, not when a request next asks: the scheduler calls this
            # every step, so the "gpu" load times (take_load_times) are right to a step
            self._poll_slots()
            usable = [n for n in dict.fromkeys(names) if self._usable(n)]
            wanted = dict.fromkeys(usable[:max(num_gpu, 0)])
            for name in self._wanted.keys() - wanted.keys():
                entry = self._entries.get(name)
                if entry is None or entry.requested or entry.slot is not None:
                    continue
                self._waiting.pop(name, None)
                if name not in self._cpu_lru:
                    entry.staged = None   # only kept for that load
            self._wanted = wanted
            may_read = True   # once the limit holds a read back, it holds the later ones (one count per call)
            for name in wanted:
                entry = self._entries[name]
                if entry.read_ahead and entry.reading is not None and entry.reading.cancel():
                    self._forget_read(entry)   # still queued behind read-ahead: read it for the GPU now
                may_read = self._move_up(entry, serve=False, may_read=may_read) and may_read
            for name in reversed(wanted):   # slots go to waiting copies in wish order, before prefetches
                if name in self._waiting:
                    self._waiting.move_to_end(name, last=False)
            room = max(self.max_cpu_adapters - len(wanted), 0)   # wanted copies land in the tier too
            for name in reversed(usable[len(wanted):len(wanted) + room]):  # the first ones most recent
                entry = self._entries[name]
                if entry.slot is not None:
                    continue
                if name in self._cpu_lru:
                    self._cpu_lru.move_to_end(name)
                elif entry.reading is None and entry.staged is None:
                    self._start_read(entry, ahead=True)
            self._serve_waiting()
            if self._deferred:
                self._start_deferred()

    def wait_resident(self, name: str, timeout: float | None = None) -> bool:
        """Prefetch and block until resident (for tools and tests; the engine never waits)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.prefetch(name)
            with self._lock:
                if self.is_resident(name):
                    return True
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                self._changed.wait(0.002 if remaining is None else min(0.002, remaining))

    def slot_owner(self, slot: int) -> str | None:
        with self._lock:
            owner = self._slot_owner[slot]
            return None if owner is None else owner.name

    def resident(self) -> list[str]:
        """Adapters usable on the GPU now."""
        with self._lock:
            return [e.name for e in self._slot_owner if e is not None and not e.removed and self._poll(e)]

    def take_load_times(self) -> list[tuple[str, float]]:
        """(stage, seconds) of the load stages finished since the last call: "disk" = read to a host copy,
        "slot_wait" = host copy ready to slot assigned, "copy_issue" = queueing the copies into the slot
        (host time, on the copier thread), "gpu" = slot assigned to copy complete (as seen by the next
        poll: `want`, every engine step, polls)."""
        with self._lock:
            out = list(self._load_times)
            self._load_times.clear()
        return out

    def counts_by_state(self) -> dict[str, int]:
        """How many registered adapters are in each state (AdapterState values)."""
        counts = {state.value: 0 for state in AdapterState}
        with self._lock:
            for entry in self._entries.values():
                counts[self._state(entry).value] += 1
        return counts

    def pins(self, name: str) -> int:
        with self._lock:
            return self._get(name).pins

    def close(self) -> None:
        self._ahead_executor.shutdown(wait=True, cancel_futures=True)
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._copier.shutdown(wait=True)
