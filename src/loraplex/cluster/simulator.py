"""Trace-driven simulation of N GPUs, each an engine replica (`sim_replica`), behind the router of
`routing`: the same `choose_replica` and `RouterQueue` the Ray application uses.

Trace (`make_trace`): the Punica workload of `loraplex bench` (bench/workload.py: prompt lengths lognormal,
total lengths uniform below max_len; adapters distinct / uniform over ⌈√n⌉ / skewed Zipf-1.5), arriving as a
Poisson process at `rate` requests per second. One seed gives one set of requests; rates only rescale the
arrival times, so every rate and policy replays the same requests.

Routing: an arriving request goes to `choose_replica(policy)` over the replicas' stats at that moment, or
waits in the router's queue (when the queue holds requests, new ones go behind them). Whenever a request
leaves a replica the queue is offered to the replicas again (`RouterQueue.pop_ready`).

Migration (Punica §5): when a replica's next step would run out of KV blocks, its newest request (by arrival)
leaves: to the replica `choose_replica` names for its prompt plus generated tokens (excluding this one),
where it is prefilled again; if none has room it is preempted and waits at the head of this replica's queue
to be recomputed, as the engine does.

GPU-busy-seconds: the time a replica spends in steps (it steps only while it has running requests).
"""
from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import numpy as np

from ..bench.workload import make_workload
from .cost_model import AdapterLoadCost, StepCostModel
from .routing import (
    OUTPUT_RESERVE,
    Policy,
    QueueFull,
    RoundRobinState,
    RouteRequest,
    RouterQueue,
    choose_replica,
    with_request,
)
from .sim_replica import SimReplica, SimSeq

POPULARITIES = ("distinct", "uniform", "skewed")


@dataclass(frozen=True)
class ClusterConfig:
    """One replica per GPU, with the engine's defaults (max_num_seqs 256, max_num_batched_tokens 2048) but 128
    adapter slots (a 7B rank-16 adapter is 80 MB) and 256 host copies. KV blocks: an H200's 141 GB × 0.90 (gpu_memory_utilization) less the 7B weights
    (13.2 GB), 128 adapter slots of 80 MB (10.2 GB) and ~4 GB of activations and graphs, over 8.4 MB per
    16-token block of llama-2-7b (0.5 MiB of K/V per token)."""
    gpus: int = 4
    max_running: int = 256
    kv_blocks: int = 11_800
    block_size: int = 16
    gpu_slots: int = 128
    cpu_slots: int = 256
    max_batched_tokens: int = 2048
    max_waiting: int = 100_000
    migrate: bool = True
    output_reserve: float = OUTPUT_RESERVE
    target_batch: int | None = None        # CONSOLIDATE's batch target (routing rule 3)

    def __post_init__(self) -> None:
        for name in ("gpus", "max_running", "kv_blocks", "block_size", "gpu_slots", "max_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"ClusterConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.cpu_slots < 0 or self.max_waiting < 0:
            raise ValueError(f"ClusterConfig.cpu_slots and max_waiting must be >= 0, got "
                             f"{self.cpu_slots}, {self.max_waiting}")


def make_trace(n: int, rate: float, popularity: str, *, seed: int = 0, max_len: int = 2048) -> list[SimSeq]:
    """n requests of the Punica workload with Poisson arrivals at `rate` req/s (module docstring)."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests per second, got {rate}")
    if popularity not in POPULARITIES:
        raise ValueError(f"popularity must be one of {POPULARITIES}, got {popularity!r}")
    w = make_workload(n, popularity, lengths="punica", max_len=max_len, seed=seed)
    gaps = np.random.default_rng(seed + 1).exponential(1.0, n)
    arrivals = np.cumsum(gaps) / rate
    return [SimSeq(r.index, float(t), r.prompt_len, r.output_len, f"lora{r.adapter}")
            for r, t in zip(w.requests, arrivals)]


@dataclass(frozen=True)
class SimResult:
    policy: str
    rate: float
    popularity: str
    gpus: int
    requests: int
    finished: int
    rejected: int
    makespan_s: float
    req_per_s: float
    tokens_per_s: float
    window_tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    busy_s: float
    busy_s_per_1k: float
    gpus_used: int
    mean_batch: float
    migrations: int
    preemptions: int
    max_router_queue: int

    def to_json(self) -> dict:
        return asdict(self)


class ClusterSim:
    """One run: a trace through N replicas under one policy (module docstring)."""

    def __init__(self, config: ClusterConfig, model: StepCostModel, loads: AdapterLoadCost,
                 policy: Policy | str) -> None:
        self.config, self.policy = config, Policy(policy)
        self.replicas = [SimReplica(f"gpu{i}", model, loads, config.max_running, config.kv_blocks,
                                    config.block_size, config.gpu_slots, config.cpu_slots,
                                    config.max_batched_tokens) for i in range(config.gpus)]
        self.by_id = {r.replica_id: r for r in self.replicas}
        self.queue: RouterQueue[SimSeq] = RouterQueue(config.max_waiting)
        self.rr = RoundRobinState()
        self.events: list = []
        self.counter = 0
        self.migrations = self.preemptions = self.rejected = self.max_queue = 0

    # --- routing ---------------------------------------------------------------------------------------------
    def _request(self, s: SimSeq) -> RouteRequest:
        return RouteRequest((s.adapter,), s.prompt + s.generated, s.output - s.generated)

    def _choose(self, s: SimSeq, now: float, exclude: frozenset[str] = frozenset()) -> str | None:
        stats = [r.stats(now) for r in self.replicas]
        return choose_replica(self._request(s), stats, self.policy, exclude=exclude, rr_state=self.rr,
                              output_reserve=self.config.output_reserve, target_batch=self.config.target_batch)

    def _dispatch_queue(self, now: float) -> None:
        if not len(self.queue):
            return
        stats = {r.replica_id: r.stats(now) for r in self.replicas}

        def choose(s: SimSeq) -> str | None:
            req = self._request(s)
            target = choose_replica(req, list(stats.values()), self.policy, rr_state=self.rr,
                                    output_reserve=self.config.output_reserve,
                                    target_batch=self.config.target_batch)
            if target is not None:
                stats[target] = with_request(stats[target], req, self.config.output_reserve)
            return target
        for s, target in self.queue.pop_ready(choose):
            self._deliver(s, target, now)

    def _deliver(self, s: SimSeq, target: str, now: float, *, first: bool = False) -> None:
        r = self.by_id[target]
        r.receive(s, now, first=first)
        self._wake(r, now)

    # --- events ----------------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, payload) -> None:
        self.counter += 1
        heapq.heappush(self.events, (t, self.counter, kind, payload))

    def _wake(self, r: SimReplica, now: float) -> None:
        """Have `r` reconsider its batch at its first step boundary at or after `now`."""
        r.version += 1
        if r.macro is not None:
            r.macro.k = max(0, r.macro.steps_by(now, completed=False))
            end = r.macro.t0 + r.macro.elapsed(r.macro.k)
        else:
            end = now
        self._push(end, "replica", (r.replica_id, r.version))

    def _replica_event(self, r: SimReplica, now: float) -> None:
        if r.commit():
            self._dispatch_queue(now)
        r.admit(now)
        if self._relieve_kv(r, now):
            self._dispatch_queue(now)
        end = r.plan(now)
        r.version += 1      # supersedes wakes pushed meanwhile: requests they brought wait in r.waiting
        if end is not None:
            self._push(end, "replica", (r.replica_id, r.version))

    def _relieve_kv(self, r: SimReplica, now: float) -> bool:
        """While `r`'s next step would run out of KV blocks, move its newest request away (or preempt it)."""
        moved = False
        while r.kv_short() and len(r.running) > 1:
            s = r.newest()
            r.release(s)
            s.prefill = s.prompt + s.generated
            r.note_preemption()
            target = self._choose(s, now, frozenset({r.replica_id})) if self.config.migrate else None
            if target is None:
                self.preemptions += 1
                r.receive(s, now, first=True)
            else:
                self.migrations += 1
                self._deliver(s, target, now)
            moved = True
        return moved

    def _arrive(self, s: SimSeq, now: float) -> None:
        target = None if len(self.queue) else self._choose(s, now)
        if target is not None:
            self._deliver(s, target, now)
            return
        try:
            self.queue.push(s)
        except QueueFull:
            self.rejected += 1
        self.max_queue = max(self.max_queue, len(self.queue))

    def run(self, trace: list[SimSeq]) -> list[SimSeq]:
        for r in self.replicas:
            r.window_end = max(s.arrival for s in trace)
        for s in trace:
            self._push(s.arrival, "arrive", s)
        while self.events:
            t, _, kind, payload = heapq.heappop(self.events)
            if kind == "arrive":
                self._arrive(payload, t)
                continue
            rid, version = payload
            r = self.by_id[rid]
            if version == r.version:
                self._replica_event(r, t)
        return trace


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def simulate(trace: list[SimSeq], config: ClusterConfig, model: StepCostModel, loads: AdapterLoadCost,
             policy: Policy | str, *, rate: float, popularity: str) -> SimResult:
    """Run `trace` (fresh copies of its requests) and summarise it."""
    seqs = [SimSeq(s.index, s.arrival, s.prompt, s.output, s.adapter) for s in trace]
    sim = ClusterSim(config, model, loads, policy)
    sim.run(seqs)
    done = [s for s in seqs if s.finish is not None]
    start = min(s.arrival for s in seqs)
    span = max(s.finish for s in done) - start if done else float("nan")
    busy = sum(r.busy_s for r in sim.replicas)
    steps = sum(r.steps for r in sim.replicas)
    return SimResult(policy=sim.policy.value, rate=rate, popularity=popularity, gpus=config.gpus,
                     requests=len(seqs), finished=len(done), rejected=sim.rejected, makespan_s=span,
                     req_per_s=len(done) / span, tokens_per_s=sum(s.output for s in done) / span,
                     window_tokens_per_s=sum(r.window_tokens for r in sim.replicas) / (
                         max(s.arrival for s in seqs) - start),
                     latency_p50_s=_pct([s.finish - s.arrival for s in done], 50),
                     latency_p99_s=_pct([s.finish - s.arrival for s in done], 99),
                     ttft_p50_s=_pct([s.first_token - s.arrival for s in done], 50),
                     ttft_p99_s=_pct([s.first_token - s.arrival for s in done], 99),
                     busy_s=busy, busy_s_per_1k=1000 * busy / max(len(done), 1),
                     gpus_used=sum(1 for r in sim.replicas if r.steps), mean_batch=sum(
                         r.seq_steps for r in sim.replicas) / max(steps, 1),
                     migrations=sim.migrations, preemptions=sim.preemptions, max_router_queue=sim.max_queue)
