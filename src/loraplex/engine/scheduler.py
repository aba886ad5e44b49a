"""The scheduler: which tokens of which sequences run in the next step (its answer, a `SchedulerOutput`,
is defined in engine/scheduler_output.py).

Each step packs, under a token budget and a cap on running sequences:
1. every running sequence's next tokens, oldest first: one token for a decode, the next chunk
   for a prompt being prefilled in pieces (chunked prefill);
2. then waiting requests, first come first served. One whose adapter is not on the GPU is
   skipped, so others go ahead meanwhile, while its adapter loads (`plan_adapter_loads`); once
   it has waited `max_queue_skip_ms` it is skipped no more: nothing behind it is admitted until it runs
   (aging), so no request starves behind a popular adapter. Distinct adapters per step are
   bounded by the GPU slots because every running request pins its adapters' slots: a request that
   combines several adapters (adapters/composition.py) is admitted only once all of them are on the
   GPU, and pins all of them or none (engine/adapter_pins.py).

When a running sequence needs a KV block and none is free, the newest running sequence (by
arrival) gives its blocks back and waits to be recomputed; its tokens so far are kept, so its
output is the same as if it had never been preempted. Recomputing costs a whole context, so each
preemption makes admission more careful for a while: a request is admitted only if the running
sequences keep room to grow `lookahead` tokens each beside it (`note_step`, `growth_reserve`), at most
`admission_lookahead` (default 256; 0 turns it off).

The engine queues some steps without `schedule` (engine/step_pipeline.py): it asks `would_admit` whether
a waiting request would go first, and admits requests into such a step with `admit_beside`.
"""
from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

from ..adapters import AdapterCache, AdapterError
from ..config import EngineConfig
from .adapter_pins import pin_adapters, unpin_adapters, want_adapters
from .block_manager import BlockManager
from .scheduler_output import ScheduledChunk, SchedulerOutput, is_decode
from .sequence import FinishReason, Sequence, SequenceStatus

# The output types are re-exported: the runner, the pipeline and step_info import them from here.
__all__ = ["ScheduledChunk", "Scheduler", "SchedulerOutput", "is_decode"]

log = logging.getLogger("loraplex.engine")


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, adapters: AdapterCache | None) -> None:
        self.config, self.blocks, self.adapters = config, blocks, adapters
        self.waiting: list[Sequence] = []   # by arrival
        self.running: list[Sequence] = []   # hold blocks; by admission
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0   # KV-cached tokens that preemptions threw away (computed again later)
        # tokens of growth the running sequences keep room for when a request is admitted (_growth): raised
        # by each preemption, decaying while none happens, at most config.admission_lookahead
        self.lookahead = 0.0
        # the last schedule() left a request that the batch had a seat and KV memory for waiting for its adapter
        self.waiting_on_adapters = False
        # free blocks kept back when admitting, so running decodes can grow without preempting at once
        self.watermark = max(1, blocks.num_blocks // 100)

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if not self.running and not self.waiting:
            self.lookahead = 0.0   # an idle engine: the last burst's preemptions say nothing of this one
        self._enqueue(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """A running or waiting sequence is done (finished, aborted or failed): free what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if seq.adapter is not None:
                self.plan_adapter_loads()   # withdraw its loads now: the engine may not step again soon
        seq.status = SequenceStatus.FINISHED

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, now: float | None = None) -> SchedulerOutput:
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[int] = set()

        # 1. running sequences: decodes first (one token each, always within the budget), then prefill chunks
        order = [s for s in self.running if s.num_uncached == 1] + [s for s in self.running if s.num_uncached > 1]
        for seq in order:
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            n = min(seq.num_uncached, budget)
            while not self.blocks.can_grow(seq, seq.num_cached + n):
                # the newest running sequence by arrival gives way, even if it was already scheduled
                # this step (admission order is not arrival order: a request may wait for its adapter)
                victim = max(self.running, key=lambda s: s.times.arrival)
                if id(victim) in scheduled:
                    dropped = next(c for c in out.chunks if c.seq is victim)
                    out.chunks.remove(dropped)
                    scheduled.discard(id(victim))
                    budget += dropped.num_tokens
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self.blocks.grow(seq, seq.num_cached + n)
            out.chunks.append(ScheduledChunk(seq, n))
            scheduled.add(id(seq))
            budget -= n

        # a migration is a preemption here: memory ran short, so nobody new comes in this step
        self.note_step(len(out.preempted) + len(out.migrated))

        # 2. waiting requests, first come first served
        self.waiting_on_adapters = False
        if not (out.preempted or out.migrated) and self.may_admit(now, budget):
            budget = self._admit(now, budget, out)
        self.plan_adapter_loads()
        return out

    def admit_beside(self, num_decodes: int, leaving: int = 0, now: float | None = None) -> SchedulerOutput:
        """Admit waiting requests into a step the engine queues while the one before still runs: beside
        `num_decodes` one-token decodes of running sequences, whose KV blocks the engine has grown already,
        while `leaving` running sequences end with the step in flight (their seats count as free; their
        blocks not yet). `schedule`'s second part, under the token budget those decodes leave; its chunks
        are the admitted prompts' first chunks, its `failed` the requests whose adapter failed to load."""
        now = time.monotonic() if now is None else now
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens - num_decodes
        self.waiting_on_adapters = False
        if budget > 0 and self.may_admit(now, budget):
            self._admit(now, budget, out, seats_freed=leaving)
        return out

    def _admit(self, now: float, budget: int, out: SchedulerOutput, seats_freed: int = 0) -> int:
        skip_after = self.config.max_queue_skip_ms / 1000
        reserve = self.growth_reserve()
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) - seats_freed >= self.config.max_num_seqs:
                break
            aged = now - seq.times.arrival >= skip_after
            try:
                slots = pin_adapters(self.adapters, seq.adapter_names)
            except AdapterError as e:  # a load failed: this request ends (engine), the others go on
                seq.error = str(e)
                out.failed.append(seq)
                continue
            if slots is None:   # loading: others go ahead, unless it has waited too long
                # the load holds the batch back only if the KV memory has room for the request
                self.waiting_on_adapters = self.waiting_on_adapters or self.fits(seq, reserve=reserve)
                if aged:
                    break
                continue
            # The whole of its tokens must fit now, or admitting it would only preempt someone soon.
            if not self.fits(seq, reserve=reserve):
                unpin_adapters(self.adapters, seq.adapter_names)
                break  # first come, first served for memory too
            n = min(seq.num_uncached, budget)
            self.blocks.grow(seq, seq.num_cached + n)
            self.waiting.remove(seq)
            seq.status, seq.adapter_slots = SequenceStatus.RUNNING, slots
            if seq.times.first_scheduled is None:
                seq.times.first_scheduled = now
            self.running.append(seq)
            out.chunks.append(ScheduledChunk(seq, n))
            budget -= n
            reserve += self._growth(seq)
        return budget

    def would_admit(self, extra_blocks: int = 0, now: float | None = None) -> bool:
        """Would `schedule` admit a waiting request now, with `extra_blocks` of the free KV blocks taken? `_admit`'s
        rules, without pinning anything: a seat and `may_admit`; requests with an adapter not on the GPU are passed
        over until aged (then nothing is admitted); the first one reached must fit (`fits`). A request with an
        adapter that failed (or is gone) counts: `schedule` would end it."""
        now = time.monotonic() if now is None else now
        if not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return False
        if not self.may_admit(now, self.config.max_num_batched_tokens - len(self.running)):
            return False
        skip_after = self.config.max_queue_skip_ms / 1000
        for seq in self.waiting:
            names = seq.adapter_names
            if any(name not in self.adapters or self.adapters.error(name) is not None for name in names):
                return True
            if not all(self.adapters.is_resident(name) for name in names):
                if now - seq.times.arrival >= skip_after:
                    return False
                continue
            return self.fits(seq, extra_blocks)
        return False

    def fits(self, seq: Sequence, extra_blocks: int = 0, reserve: int | None = None) -> bool:
        """Do all of its tokens fit in the free KV blocks (less `extra_blocks`) now, beside the watermark
        and the `reserve` of the running sequences' growth (`growth_reserve()` unless given), if others run?"""
        need = self.blocks.blocks_for(seq.num_tokens)
        free = self.blocks.num_free - extra_blocks
        if not self.running:
            return need <= free
        reserve = self.growth_reserve() if reserve is None else reserve
        return need + reserve <= free - self.watermark

    def growth_reserve(self) -> int:
        """Blocks the running sequences need to grow `lookahead` tokens each (`_growth`)."""
        return sum(self._growth(s) for s in self.running) if self.lookahead >= 1 else 0

    # The lookahead's rise per preemption and fall per step without one: chosen on the scheduler alone
    # (docs/design-notes.md).
    LOOKAHEAD_UP = 128.0
    LOOKAHEAD_DECAY = 1.0

    def note_step(self, preemptions: int) -> None:
        """One engine step ran (`schedule` calls it; so does the engine for a step it queued without
        scheduling) with this many preemptions: the lookahead rises or decays."""
        if preemptions:
            raised = self.lookahead + self.LOOKAHEAD_UP * preemptions
            self.lookahead = min(float(self.config.admission_lookahead), raised)
        else:
            self.lookahead = max(0.0, self.lookahead - self.LOOKAHEAD_DECAY)

    def _growth(self, seq: Sequence) -> int:
        """Blocks beyond those of its tokens now that `seq` needs to grow `lookahead` more tokens (no more
        than its max_tokens allows; the model's length limit is not known here, so it may count a few more)."""
        lookahead = int(self.lookahead)
        if not lookahead:
            return 0
        grown = seq.num_tokens + min(lookahead, max(seq.params.max_tokens - seq.num_output_tokens, 0))
        return self.blocks.blocks_for(grown) - self.blocks.blocks_for(seq.num_tokens)

    def may_admit(self, now: float, budget: int) -> bool:
        """The latency ↔ throughput setting: while sequences are decoding, new prompts may wait up
        to `max_batch_wait_ms` for enough company to fill a step, unless the batch is full anyway."""
        wait = self.config.max_batch_wait_ms / 1000
        if wait <= 0 or not self.running or not self.waiting:
            return True
        if now - self.waiting[0].times.arrival >= wait:
            return True
        seats = self.config.max_num_seqs - len(self.running)
        queued = self.waiting[:max(seats, 0)]
        return len(queued) >= seats or sum(s.num_uncached for s in queued) >= budget

    def plan_adapter_loads(self) -> None:
        """Tell the adapter cache what the waiting requests need (`want_adapters`). The engine calls it every step."""
        if self.adapters is not None:
            want_adapters(self.adapters, self.waiting, self.running, self.config)

    # ---- internals ------------------------------------------------------------------------------
    # A cluster replica's hook (cluster/replica_engine.py): called with a running sequence about to be preempted;
    # True takes it away instead: its blocks and adapter pins are freed and it ends as MIGRATED (it moves to
    # another replica, which recomputes it). None (the default): preemption as usual.
    migrate: Callable[[Sequence], bool] | None = None

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.migrate is not None and self.migrate(seq):
            self.running.remove(seq)
            self._release(seq)
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, FinishReason.MIGRATED
            out.migrated.append(seq)
            log.debug("migrated %s (recomputed on another replica)", seq.request_id)
            return
        self.num_recomputed_tokens += seq.num_cached
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(seq)
        out.preempted.append(seq)
        log.debug("preempted %s (recomputed later)", seq.request_id)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        if seq.adapter_slots:
            unpin_adapters(self.adapters, seq.adapter_names)
            seq.adapter_slots = ()

    def _enqueue(self, seq: Sequence) -> None:
        keys = [s.times.arrival for s in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, seq.times.arrival), seq)
