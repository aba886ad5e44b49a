"""The engine of one cluster replica: loraplex's `Engine`, plus what moving requests between replicas needs.

- **Resume**: a request begun on another replica arrives with the output tokens made there (`Resumed`, a prompt
  that carries them). They become this sequence's output, fed through its detokenizer and marked as sent, so it is
  prefilled with prompt + those tokens and goes on exactly where it stopped: the next token is the one the first
  replica would have sampled (greedy), stop strings and max_tokens count the whole output.
- **Migration** (Punica §5): where the scheduler would preempt a running sequence for lack of KV blocks, it asks
  `_migrate` first (`Scheduler.migrate`); when another replica has room for it (`PeerRoom`, pushed by the ingress),
  the sequence ends here as MIGRATED instead, its blocks freed at once, and the ingress resumes it there.
- **Held blocks**: `hold_kv_blocks` takes KV blocks out of use (memory left to another process; a small budget).

`engine_report` is what the replica tells the router, read on the engine's thread.
"""
from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence as Seq

from ..adapters import AdapterState
from ..adapters.composition import AdapterRef
from ..config import EngineConfig
from ..engine.engine import Engine
from ..engine.outputs import RequestOutput, make_output
from ..engine.sequence import FinishReason, Sequence
from ..sampling import SamplingParams
from .routing import RouteRequest, blocks_needed


class Resumed(list):
    """A prompt's token ids, carrying the output tokens `generated` for it on another replica."""

    def __init__(self, prompt: Seq[int], generated: Seq[int]) -> None:
        super().__init__(prompt)
        self.generated = [int(t) for t in generated]


class PeerRoom:
    """Free KV blocks of the other ready replicas that have a free seat, as the ingress last pushed them;
    `take` books blocks on one of them for a sequence about to migrate (so one push is not spent twice)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[int] = []

    def set(self, free_blocks: Seq[int]) -> None:
        if any(int(b) < 0 for b in free_blocks):
            raise ValueError(f"free_blocks must be >= 0, got {list(free_blocks)}")
        with self._lock:
            self._free = sorted((int(b) for b in free_blocks), reverse=True)

    def take(self, blocks: int) -> bool:
        """Book `blocks` on the replica with the most free; False when none has that many."""
        with self._lock:
            if not self._free or self._free[0] < blocks:
                return False
            self._free[0] -= blocks
            self._free.sort(reverse=True)
            return True

    def snapshot(self) -> list[int]:
        with self._lock:
            return list(self._free)


class ReplicaEngine(Engine):
    def __init__(self, config: EngineConfig, adapters: dict[str, str | Path] | None = None,
                 migration: bool = True) -> None:
        super().__init__(config, adapters)
        self.peers = PeerRoom()
        self.num_migrations = 0
        self._migrated: list[Sequence] = []
        self._held: Sequence | None = None
        if migration:
            self.scheduler.migrate = self._migrate

    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    adapter: AdapterRef = None) -> Sequence:
        seq = super().add_request(request_id, prompt, params, adapter)
        generated = getattr(prompt, "generated", None)
        if generated:
            resume(seq, generated)
        return seq

    def _migrate(self, seq: Sequence) -> bool:
        """Called by the scheduler (engine thread) instead of preempting `seq`: True when a peer has room."""
        remaining = max(seq.params.max_tokens - seq.num_output_tokens, 0)
        need = blocks_needed(RouteRequest(seq.adapter_names, seq.num_tokens, remaining), self.blocks.block_size)
        if not self.peers.take(need):
            return False
        self._migrated.append(seq)
        self.num_migrations += 1
        return True

    def step(self) -> list[RequestOutput]:
        outputs = super().step()
        for seq in self._migrated:   # the scheduler freed them; they end here (FinishReason.MIGRATED)
            self._finish(seq, FinishReason.MIGRATED)
            outputs.append(make_output(seq))
        self._migrated.clear()
        return outputs

    def hold_kv_blocks(self, count: int) -> int:
        """Keep `count` KV blocks out of use (0 gives them back); call on the engine's thread, between steps.
        Returns the blocks held. Blocks in use by requests are not taken: at most the free ones are held."""
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an integer >= 0, got {count!r}")
        if self._held is not None:
            self.blocks.free(self._held)
        self._held = Sequence("__held_kv_blocks__", [0], SamplingParams())
        take = min(count, self.blocks.num_free)
        self.blocks.grow(self._held, take * self.blocks.block_size)
        return take


def resume(seq: Sequence, generated: Seq[int]) -> None:
    """Make `generated` the output `seq` has produced and reported already (its detokenizer sees each token,
    as if sampled here); logprobs of those tokens stay with whoever reported them (None placeholders here)."""
    for token in generated:
        seq.token_ids.append(token)
        if seq.text is not None:
            seq.text.append(token)
    if seq.logprobs is not None:
        seq.logprobs.extend([None] * len(generated))
    seq.sent_tokens = seq.num_output_tokens
    if seq.text is not None:
        seq.text.take_new()   # released before the move: the next output's new_text starts after it


def engine_report(engine: Engine, held_blocks: int = 0) -> dict:
    """The engine's part of what a replica tells the router (messages.py lists it), read on the engine's thread:
    seats, KV blocks, adapter slots that no running or queued request holds, adapters on the GPU (or being copied
    there) and in host memory, and every adapter's tier for the metrics."""
    scheduler, blocks, adapters = engine.scheduler, engine.blocks, engine.adapters
    pinned = {name for seq in scheduler.running for name in seq.adapter_names}
    queued = {name for seq in scheduler.waiting for name in seq.adapter_names}
    gpu, cpu = [], []
    for name in adapters.names():
        state = adapters.state(name)
        if state in (AdapterState.GPU, AdapterState.LOADING):   # (loading: in its slot in a moment)
            gpu.append(name)
        elif state is AdapterState.CPU:
            cpu.append(name)
    tiers = adapters.counts_by_state()
    # a slot is free when neither a running request pins it nor a queued one will: the queued requests' adapters
    # take slots as they are admitted, so the router must not count those slots for another adapter
    claimed = len(pinned | queued)
    return {"running": len(scheduler.running), "waiting": len(scheduler.waiting),
            "max_running": engine.config.max_num_seqs, "free_kv_blocks": blocks.num_free,
            "total_kv_blocks": blocks.num_blocks - held_blocks, "block_size": blocks.block_size,
            "free_gpu_slots": max(engine.config.max_gpu_adapters - claimed, 0),
            "gpu_adapters": sorted(gpu), "cpu_adapters": sorted(cpu),
            "running_adapters": sorted(pinned), "waiting_adapters": sorted(queued),
            "tiers": {"gpu": tiers.get("gpu", 0), "cpu": tiers.get("cpu", 0),
                      "disk": tiers.get("disk", 0) + tiers.get("reading", 0),
                      "loading": tiers.get("loading", 0), "failed": tiers.get("failed", 0)}}
