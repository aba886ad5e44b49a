"""Which replica serves a request: Punica's consolidation, least-loaded and round-robin, as pure functions.

Replicas report `ReplicaStats`; a request is described by `RouteRequest`; `choose_replica` names a replica
or None (no replica has room now: the request waits at the router, in a bounded `RouterQueue`). No Ray, no
torch: the Ray Serve router and the cluster simulator call the same code.

Rules:
1. A replica is a candidate when it is ready and its id is not in `exclude` (a failed replica, the one a
   request migrates away from).
2. A candidate has **room** for a request when all of:
   a. seats: running + waiting < max_running (a request queued in the replica's scheduler takes a seat too);
   b. KV: free_kv_blocks >= ceil((prompt_tokens + ceil(output_reserve * max_new_tokens)) / block_size).
      The prompt is counted whole (it is prefilled at once); the output by a fraction `output_reserve`
      (default `OUTPUT_RESERVE` = 0.5). Counting the whole max_new_tokens would turn requests away from
      replicas with plenty of memory because clients set max_tokens far above what they generate; counting
      none would let consolidation fill a replica's memory with prompts whose decodes then run it out of
      blocks, each such shortage costing a migration (a re-prefill). The engine's own admission (prompt plus
      a growth lookahead) still guards the replica; the simulator counts the migrations this choice leaves;
   c. adapters: the members of the request not resident on the GPU number at most free_gpu_slots (each
      needs a slot that no running request pins). A base-model request (no adapters) needs none.
3. CONSOLIDATE (Punica §5): among replicas with room that hold every member adapter on the GPU, the one
   with the largest running batch; else among replicas with room, the largest running batch, ties going
   to the one holding more members in host memory (a cheaper load); in both, further ties go to the
   fewest free KV blocks (the fuller replica), then the smallest id. A base-model request takes the
   largest running batch with room (same tie-breaks). Batches stay large, so idle replicas stay idle and
   can be released. With `target_batch` set, a replica whose running + waiting reached it is passed over
   while another with room is below it; when every replica with room has reached it, the request goes as
   LEAST_LOADED would send it (a batch beyond the target only adds latency, so spread the load).
4. LEAST_LOADED: among replicas with room, the fewest running + waiting; ties go to the replica holding
   more member adapters on the GPU, then in host memory, then the most free KV blocks, then the smallest id.
5. ROUND_ROBIN: replicas in id order, taken in turn: the first one with room after the one chosen last
   (`RoundRobinState`), wrapping around. Without a state it starts from the smallest id.
6. No candidate with room: None.
7. `RouterQueue` holds requests that got None, first come first served, at most `max_waiting` (`QueueFull`
   beyond: the server answers 429). `pop_ready` dispatches queued requests in order, passing over one that
   cannot be placed yet, until the head has been passed over `max_head_skips` times: then nothing behind it
   goes until it does (aging, so a request needing a big replica does not starve behind small ones).
"""
from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

OUTPUT_RESERVE = 0.5        # fraction of max_new_tokens counted against free KV blocks (rule 2b)


def _check_nonneg(owner: str, **fields: int) -> None:
    for name, value in fields.items():
        if value < 0:
            raise ValueError(f"{owner}.{name} must be >= 0, got {value}")


@dataclass(frozen=True)
class ReplicaStats:
    """What a replica reports to the router."""
    replica_id: str
    ready: bool = True
    running: int = 0          # running sequences
    waiting: int = 0          # queued in the replica's scheduler
    max_running: int = 32     # its max_num_seqs
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    block_size: int = 16
    free_gpu_slots: int = 0   # adapter slots not pinned by running requests
    gpu_adapters: frozenset[str] = frozenset()   # resident on the GPU
    cpu_adapters: frozenset[str] = frozenset()   # in host memory

    def __post_init__(self) -> None:
        if not self.replica_id:
            raise ValueError("ReplicaStats.replica_id must be a non-empty string")
        _check_nonneg("ReplicaStats", running=self.running, waiting=self.waiting,
                      free_kv_blocks=self.free_kv_blocks, total_kv_blocks=self.total_kv_blocks,
                      free_gpu_slots=self.free_gpu_slots)
        if self.max_running < 1:
            raise ValueError(f"ReplicaStats.max_running must be >= 1, got {self.max_running}")
        if self.block_size < 1:
            raise ValueError(f"ReplicaStats.block_size must be >= 1, got {self.block_size}")


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request."""
    adapters: tuple[str, ...] = ()   # member adapters (empty: base model; a composition names several)
    prompt_tokens: int = 0           # tokens to prefill (prompt, plus generated ones when migrating)
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        _check_nonneg("RouteRequest", prompt_tokens=self.prompt_tokens, max_new_tokens=self.max_new_tokens)
        if any(not a for a in self.adapters):
            raise ValueError(f"RouteRequest.adapters must name adapters, got {self.adapters!r}")


class Policy(str, enum.Enum):
    CONSOLIDATE = "consolidate"
    LEAST_LOADED = "least_loaded"
    ROUND_ROBIN = "round_robin"


@dataclass
class RoundRobinState:
    """The replica round-robin chose last (rule 5); one per router."""
    last: str | None = None


def blocks_needed(request: RouteRequest, block_size: int, output_reserve: float = OUTPUT_RESERVE) -> int:
    """KV blocks rule 2b asks a replica to have free for `request`."""
    tokens = request.prompt_tokens + math.ceil(output_reserve * request.max_new_tokens)
    return -(-tokens // block_size)


def missing_adapters(request: RouteRequest, replica: ReplicaStats) -> frozenset[str]:
    """Member adapters of `request` not resident on the replica's GPU."""
    return frozenset(request.adapters) - replica.gpu_adapters


def has_room(request: RouteRequest, replica: ReplicaStats, output_reserve: float = OUTPUT_RESERVE) -> bool:
    """Rule 2 (readiness is rule 1, checked here too)."""
    if not replica.ready or replica.running + replica.waiting >= replica.max_running:
        return False
    if replica.free_kv_blocks < blocks_needed(request, replica.block_size, output_reserve):
        return False
    return len(missing_adapters(request, replica)) <= replica.free_gpu_slots


def _on_gpu(request: RouteRequest, r: ReplicaStats) -> int:
    return len(frozenset(request.adapters) & r.gpu_adapters)


def _on_cpu(request: RouteRequest, r: ReplicaStats) -> int:
    return len(missing_adapters(request, r) & r.cpu_adapters)


def _consolidate(request: RouteRequest, fits: list[ReplicaStats], target: int | None) -> ReplicaStats:
    if target is not None:
        below = [r for r in fits if r.running + r.waiting < target]
        if not below:
            return _least_loaded(request, fits)
        fits = below
    holding = [r for r in fits if not missing_adapters(request, r)]
    pool = holding or fits
    return min(pool, key=lambda r: (-r.running, -_on_cpu(request, r), r.free_kv_blocks, r.replica_id))


def _least_loaded(request: RouteRequest, fits: list[ReplicaStats]) -> ReplicaStats:
    return min(fits, key=lambda r: (r.running + r.waiting, -_on_gpu(request, r), -_on_cpu(request, r),
                                    -r.free_kv_blocks, r.replica_id))


def _round_robin(fits: list[ReplicaStats], state: RoundRobinState | None) -> ReplicaStats:
    ordered = sorted(fits, key=lambda r: r.replica_id)
    last = state.last if state is not None else None
    after = [r for r in ordered if last is None or r.replica_id > last]
    return (after or ordered)[0]


def choose_replica(request: RouteRequest, replicas: Sequence[ReplicaStats],
                   policy: Policy = Policy.CONSOLIDATE, *, exclude: frozenset[str] = frozenset(),
                   rr_state: RoundRobinState | None = None,
                   output_reserve: float = OUTPUT_RESERVE, target_batch: int | None = None) -> str | None:
    """The id of the replica that should serve `request` under `policy` (module docstring, rules 1-6), or
    None when none has room. Updates `rr_state` when round-robin chooses. `target_batch`: CONSOLIDATE's
    batch target (rule 3), None for none."""
    try:
        policy = Policy(policy)
    except ValueError:
        raise ValueError(f"policy must be one of {[p.value for p in Policy]}, got {policy!r}") from None
    if not 0.0 <= output_reserve <= 1.0:
        raise ValueError(f"output_reserve must be in [0, 1], got {output_reserve}")
    if target_batch is not None and target_batch < 1:
        raise ValueError(f"target_batch must be >= 1 or None, got {target_batch}")
    ids = [r.replica_id for r in replicas]
    if len(set(ids)) != len(ids):
        raise ValueError(f"replica ids must be unique, got {ids}")
    fits = [r for r in replicas if r.replica_id not in exclude and has_room(request, r, output_reserve)]
    if not fits:
        return None
    if policy is Policy.CONSOLIDATE:
        chosen = _consolidate(request, fits, target_batch)
    elif policy is Policy.LEAST_LOADED:
        chosen = _least_loaded(request, fits)
    else:
        chosen = _round_robin(fits, rr_state)
        if rr_state is not None:
            rr_state.last = chosen.replica_id
    return chosen.replica_id


def with_request(replica: ReplicaStats, request: RouteRequest,
                 output_reserve: float = OUTPUT_RESERVE) -> ReplicaStats:
    """The replica's stats as the router should assume them right after sending it `request`, until its
    next report: one more waiting, the request's blocks taken, missing members loaded into free slots."""
    missing = missing_adapters(request, replica)
    return replace(replica, waiting=replica.waiting + 1,
                   free_kv_blocks=max(0, replica.free_kv_blocks
                                      - blocks_needed(request, replica.block_size, output_reserve)),
                   free_gpu_slots=max(0, replica.free_gpu_slots - len(missing)),
                   gpu_adapters=replica.gpu_adapters | missing)


class QueueFull(Exception):
    """The router's queue holds `max_waiting` requests already (the server answers 429)."""

    def __init__(self, max_waiting: int) -> None:
        super().__init__(f"router queue is full ({max_waiting} requests waiting)")
        self.max_waiting = max_waiting


T = TypeVar("T")


@dataclass
class RouterQueue(Generic[T]):
    """Bounded FIFO of requests waiting at the router for a replica with room (rule 7)."""
    max_waiting: int
    max_head_skips: int = 8
    _items: deque = field(default_factory=deque, init=False, repr=False)
    _head_skips: int = field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise ValueError(f"RouterQueue.max_waiting must be >= 0, got {self.max_waiting}")
        if self.max_head_skips < 0:
            raise ValueError(f"RouterQueue.max_head_skips must be >= 0, got {self.max_head_skips}")

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._items))

    def push(self, item: T) -> None:
        """Queue `item` last; QueueFull when `max_waiting` are queued already."""
        if len(self._items) >= self.max_waiting:
            raise QueueFull(self.max_waiting)
        self._items.append(item)

    def remove(self, item: T) -> bool:
        """Drop `item` (its client went away); False when it was not queued."""
        if not self._items or item not in self._items:
            return False
        if self._items[0] is item or self._items[0] == item:
            self._head_skips = 0
        self._items.remove(item)
        return True

    def pop_ready(self, choose: Callable[[T], str | None]) -> list[tuple[T, str]]:
        """Take the queued requests `choose` can place now, in order, with their replica ids. `choose` is
        called once per request visited, in queue order, and should account for the requests placed
        before it in this call (e.g. through `with_request`)."""
        items = list(self._items)
        placed: list[tuple[T, str]] = []
        kept: deque = deque()
        for i, item in enumerate(items):
            target = choose(item)
            if target is not None:
                placed.append((item, target))
                if i == 0:
                    self._head_skips = 0
                continue
            kept.append(item)
            if i == 0:
                self._head_skips += 1
                if self._head_skips > self.max_head_skips:   # aged: the head goes first
                    kept.extend(items[1:])
                    break
        self._items = kept
        return placed
