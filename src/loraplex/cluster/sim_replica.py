"""One simulated engine replica for the cluster simulator: continuous batching over paged KV blocks, adapter
slots with LRU eviction, steps timed by the fitted cost model.

The replica runs "macro steps": runs of engine steps over which its batch does not change, so one macro step
of k steps is timed in closed form. Step j of it (0-based) reads the batch's context C0 + j·B tokens:

    T(k) = P + k·(base + c·C0) + c·B·k(k−1)/2       (P: the prefill of the requests admitted at its start)

A macro step ends at the first request to finish, before the batch would run out of KV blocks, when a
waiting request's adapter load completes, or earlier when the simulator cuts it (a request arrived for this
replica: it is admitted at the next step boundary, as continuous batching does).

Engine rules kept (engine/scheduler.py): every running request gains one token per step; waiting requests are
admitted first come first served at step boundaries when a seat is free, the prompt tokens fit the step's
token budget and the KV blocks fit beside the running requests' growth `lookahead` (which rises 128 per
preemption or migration, falls one per step, at most 256), passing over those whose adapter still loads.
Simplified: no chunked prefill (a prompt over the token budget runs in one step), no aging of the queue.
"""
from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from .cost_model import AdapterLoadCost, StepCostModel
from .routing import ReplicaStats

LOOKAHEAD_UP, LOOKAHEAD_MAX = 128, 256


@dataclass(eq=False)
class SimSeq:
    """A request in flight: its trace fields and its progress."""
    index: int
    arrival: float
    prompt: int
    output: int
    adapter: str
    generated: int = 0
    ctx: int = 0                   # tokens in this replica's KV
    prefill: int = 0               # tokens to prefill when admitted (prompt, plus generated after a move)
    eligible_at: float = 0.0       # when its adapter is on the GPU
    first_token: float | None = None
    fresh: bool = False            # admitted, its prefill not yet run
    finish: float | None = None
    finishes: int = 0

    def __post_init__(self) -> None:
        self.prefill = self.prompt


@dataclass
class Macro:
    t0: float
    k: int
    batch: int
    ctx0: int
    per_step_s: float              # base + c·C0, seconds
    growth_s: float                # c·B, seconds
    prefill_s: float

    def elapsed(self, j: int) -> float:
        if j <= 0:
            return 0.0
        return self.prefill_s + j * self.per_step_s + self.growth_s * j * (j - 1) / 2

    def steps_by(self, t: float, *, completed: bool) -> int:
        """Steps whose boundary is ≤ t (completed) or the fewest steps whose boundary is ≥ t; at most k."""
        d = t - self.t0
        if d <= 0:
            return 0
        v, u, rest = self.growth_s, self.per_step_s, d - self.prefill_s
        if v > 0:
            bq = u - v / 2
            j = max(1, math.ceil((-bq + math.sqrt(bq * bq + 2 * v * max(rest, 0.0))) / v))
        else:
            j = max(1, math.ceil(rest / u)) if u > 0 else 1
        while j > 1 and self.elapsed(j - 1) >= d:
            j -= 1
        while self.elapsed(j) < d and j < self.k:
            j += 1
        if completed and self.elapsed(j) > d:
            j -= 1
        return min(j, self.k)


@dataclass
class SimReplica:
    replica_id: str
    model: StepCostModel
    loads: AdapterLoadCost
    max_running: int
    kv_blocks: int
    block_size: int
    gpu_slots: int
    cpu_slots: int
    max_batched_tokens: int
    running: list[SimSeq] = field(default_factory=list)
    waiting: deque = field(default_factory=deque)
    gpu: OrderedDict = field(default_factory=OrderedDict)      # adapter → time its load completes, LRU order
    cpu: OrderedDict = field(default_factory=OrderedDict)      # adapters in host memory, LRU order
    pins: Counter = field(default_factory=Counter)             # adapter → requests here that use it
    macro: Macro | None = None
    version: int = 0
    lookahead: float = 0.0
    busy_s: float = 0.0
    steps: int = 0
    seq_steps: int = 0                                         # Σ batch over steps: mean batch = seq_steps/steps
    window_end: float = math.inf                               # tokens made before it count in window_tokens
    window_tokens: int = 0

    # --- what the router sees ---------------------------------------------------------------------------------
    def blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def used_blocks(self, extra: int = 0) -> int:
        return sum(self.blocks(s.ctx + extra) for s in self.running)

    def stats(self, now: float) -> ReplicaStats:
        done = self.macro.steps_by(now, completed=True) if self.macro else 0
        pinned = sum(1 for a in self.pins if self.pins[a])
        return ReplicaStats(self.replica_id, running=len(self.running), waiting=len(self.waiting),
                            max_running=self.max_running, free_kv_blocks=max(0, self.kv_blocks - self.used_blocks(done)),
                            total_kv_blocks=self.kv_blocks, block_size=self.block_size,
                            free_gpu_slots=self.gpu_slots - pinned, gpu_adapters=frozenset(self.gpu),
                            cpu_adapters=frozenset(self.cpu))

    # --- requests in and out ----------------------------------------------------------------------------------
    def receive(self, seq: SimSeq, now: float, *, first: bool = False) -> None:
        """Queue `seq` here (first: at the head, a preempted request), loading its adapter if needed."""
        self.pins[seq.adapter] += 1
        if seq.adapter in self.gpu:
            self.gpu.move_to_end(seq.adapter)
        else:
            self._evict_one()
            in_host = seq.adapter in self.cpu
            self.gpu[seq.adapter] = now + self.loads.load_s(in_host)
        self.cpu[seq.adapter] = True
        self.cpu.move_to_end(seq.adapter)
        while len(self.cpu) > self.cpu_slots:
            self.cpu.popitem(last=False)
        seq.eligible_at = self.gpu[seq.adapter]
        (self.waiting.appendleft if first else self.waiting.append)(seq)

    def _evict_one(self) -> None:
        if len(self.gpu) < self.gpu_slots:
            return
        for name in self.gpu:                                  # least recently used, not pinned
            if not self.pins[name]:
                del self.gpu[name]
                return
        raise RuntimeError(f"replica {self.replica_id}: every GPU slot is pinned (the router over-booked it)")

    def release(self, seq: SimSeq) -> None:
        """`seq` leaves this replica (finished or moved): its blocks and its adapter pin go."""
        self.running.remove(seq)
        self.pins[seq.adapter] -= 1
        seq.ctx = 0

    # --- the engine -------------------------------------------------------------------------------------------
    def commit(self) -> list[SimSeq]:
        """Apply the macro step (it ends now); return the requests that finished."""
        m, self.macro = self.macro, None
        if m is None:
            return []
        j = m.k                                                # the simulator ends a macro step at a boundary
        in_window = j if m.t0 + m.elapsed(j) <= self.window_end else m.steps_by(self.window_end, completed=True)
        self.window_tokens += in_window * m.batch
        if j:
            self.busy_s += m.elapsed(j)
            self.steps += j
            self.seq_steps += j * m.batch
            self.lookahead = max(0.0, self.lookahead - j)
            first_at = m.t0 + m.elapsed(1)
        done = []
        for s in list(self.running) if j else []:
            s.ctx += j
            s.generated += j
            s.fresh = False
            if s.first_token is None:
                s.first_token = first_at
            if s.generated >= s.output:
                s.finish, s.finishes = m.t0 + m.elapsed(j), s.finishes + 1
                self.release(s)
                done.append(s)
        return done

    def kv_short(self) -> bool:
        """Would the next step run out of KV blocks?"""
        return bool(self.running) and self.used_blocks(1) > self.kv_blocks

    def newest(self) -> SimSeq:
        return max(self.running, key=lambda s: (s.arrival, s.index))

    def note_preemption(self) -> None:
        self.lookahead = min(float(LOOKAHEAD_MAX), self.lookahead + LOOKAHEAD_UP)

    def admit(self, now: float) -> None:
        """Admit waiting requests (module docstring)."""
        budget, prefill, kept = self.max_batched_tokens - len(self.running), 0, deque()
        growth = sum(self.blocks(s.ctx + min(int(self.lookahead), s.output - s.generated)) - self.blocks(s.ctx)
                     for s in self.running)
        free = self.kv_blocks - self.used_blocks() - max(1, self.kv_blocks // 100)
        blocked = False
        while self.waiting:
            s = self.waiting.popleft()
            if blocked or s.eligible_at > now:
                kept.append(s)
                continue
            need = self.blocks(s.prefill + 1)
            fits = need <= free - growth if self.running else need <= free
            if len(self.running) >= self.max_running or not fits or (prefill and s.prefill > budget - prefill):
                blocked = True                                  # first come first served: nobody passes it
                kept.append(s)
                continue
            s.ctx, s.fresh, prefill, free = s.prefill, True, prefill + s.prefill, free - need
            self.running.append(s)
        self.waiting = kept

    def plan(self, now: float) -> float | None:
        """Start the next macro step at `now`; return when it ends (None: idle, nothing to wait for)."""
        if not self.running:
            loading = [s.eligible_at for s in self.waiting if s.eligible_at > now]
            return min(loading) if loading else None
        b = len(self.running)
        ctx0 = sum(s.ctx for s in self.running)
        d = len({s.adapter for s in self.running})
        mm = self.model
        prefill = sum(s.prefill for s in self.running if s.fresh)
        base_ms = mm.a + mm.b * b + mm.d * d + (mm.e if d else 0.0)
        m = Macro(now, 0, b, ctx0, (base_ms + mm.c * ctx0) / 1000, mm.c * b / 1000, mm.p * prefill / 1000)
        k = min(s.output - s.generated for s in self.running)
        k = min(k, self._kv_steps(k))
        loading = [s.eligible_at for s in self.waiting if s.eligible_at > now]
        m.k = k
        if loading:                                             # stop at the boundary after the first load completes
            m.k = max(1, m.steps_by(min(loading), completed=False))
        self.macro = m
        return now + m.elapsed(m.k)

    def _kv_steps(self, limit: int) -> int:
        """The most steps (≤ limit, ≥ 1: the caller moved requests until one fits) whose KV fits."""
        if self.used_blocks(limit) <= self.kv_blocks:
            return limit
        lo, hi = 1, limit                                       # used_blocks(lo) fits, used_blocks(hi) does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.used_blocks(mid) <= self.kv_blocks else (lo, mid)
        return lo
