"""The engine: requests in, tokens out. One `step()` = schedule → run → postprocess.

Not thread-safe: one thread drives it (the offline `LLM` loop, or `AsyncEngine`'s worker).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence as Seq

import torch

from ..adapters import AdapterError
from ..config import EngineConfig
from ..sampling import SamplingParams
from .block_manager import BlockManager
from .gc_heap import freeze_heap, release_heap
from .model_runner import ModelRunner
from .outputs import RequestOutput, make_output
from .requests import prompt_token_ids, stop_reason
from .scheduler import ScheduledChunk, Scheduler, is_decode
from .sequence import FinishReason, Sequence, SequenceStatus
from .step_info import Launched, StepInfo

log = logging.getLogger("loraplex.engine")


class Engine:
    def __init__(self, config: EngineConfig, adapters: dict[str, str | Path] | None = None) -> None:
        self.config = config
        self.runner = ModelRunner(config)
        self.adapters = self.runner.adapters
        self.model_config = self.runner.model.config
        self.tokenizer = self._load_tokenizer()
        self.blocks = BlockManager(self.runner.kv.num_blocks, self.runner.kv.block_size)
        self.scheduler = Scheduler(config, self.blocks, self.adapters)
        self.max_model_len = self.runner.max_model_len
        eos = set(self.model_config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self._requests: dict[str, Sequence] = {}
        self.last_step: StepInfo | None = None
        self._inflight: Launched | None = None   # a step queued on the GPU, not yet postprocessed
        self.stats = {"steps": 0, "graph_steps": 0, "mixed_graph_steps": 0, "overlapped_steps": 0,
                      "overlapped_admissions": 0,   # steps queued ahead that admitted prompts
                      "tokens_prefilled": 0, "tokens_generated": 0}
        for name, path in (adapters or {}).items():
            self.add_adapter(name, path)
        self._frozen = False
        if config.freeze_gc_heap:
            self.freeze_heap()

    def freeze_heap(self) -> None:
        """Put the objects alive now out of the garbage collector's full passes (engine/gc_heap.py): done
        at start, and worth calling again after registering many adapters. A no-op with freeze_gc_heap off."""
        if self.config.freeze_gc_heap:
            freeze_heap(first=not self._frozen)
            self._frozen = True

    def _load_tokenizer(self):
        from .detokenizer import load_tokenizer
        if self.config.tokenizer is not None:
            return load_tokenizer(self.config.tokenizer)
        if self.config.is_dummy:
            return None
        try:
            return load_tokenizer(self.config.model)
        except ValueError as e:
            log.warning("no tokenizer (%s): prompts must be token ids, outputs carry no text", e)
            return None

    # ---- adapters ---------------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path) -> None:
        """Register a PEFT adapter folder (validated now; its weights load when first used)."""
        self.adapters.register(name, path)

    def remove_adapter(self, name: str) -> None:
        self.adapters.unregister(name)

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    adapter: str | None = None) -> Sequence:
        """Queue a request; every problem with it is a ValueError now, never a failure later."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params.check_vocab(self.model_config.vocab_size)
        text_prompt, token_ids = prompt_token_ids(prompt, self.tokenizer, self.model_config.vocab_size)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this engine serves at most "
                             f"{self.max_model_len} tokens per sequence (max_model_len), output included")
        if adapter is not None:
            if not isinstance(adapter, str) or adapter not in self.adapters:
                known = ", ".join(self.adapters.names()[:20]) or "none"
                raise AdapterError(f"unknown adapter {adapter!r} (registered: {known})")
            if self.adapters.error(adapter) is not None:
                raise AdapterError(f"adapter {adapter!r} failed to load: {self.adapters.error(adapter)}")
            # its load is ordered by the scheduler's plan (queue order, into free slots), from the next step
        seq = Sequence(request_id, token_ids, params, adapter=adapter, prompt=text_prompt)
        if params.seed is not None:
            seq.generator = self.runner.new_generator(params.seed)
        if self.tokenizer is not None:
            from .detokenizer import OutputText
            seq.text = OutputText(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
        elif params.stop:
            raise ValueError("stop strings need a tokenizer; this engine has none (use stop_token_ids)")
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now: its KV blocks and its adapter pin are released at once."""
        seq = self._requests.get(request_id)
        if seq is None:
            return None
        self._finish(seq, FinishReason.ABORT)
        return make_output(seq)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one step and postprocess it; an output for every request that progressed.

        Steps overlap: when the step just launched is all decodes (or last prompt chunks), the next
        step is queued on the GPU before this one's tokens reach the host, its decodes' inputs taken
        from this step's sample on the device, beside the prompts of requests admitted now
        (`overlap_admissions`). The host then postprocesses while the GPU runs, so a step costs its
        GPU time.
        """
        start = time.perf_counter()
        self.last_step = None   # stays None when nothing ran (callers may then wait a little)
        outputs: list[RequestOutput] = []
        current, self._inflight = self._inflight, None
        continued = current is not None and any(c.seq.status is SequenceStatus.RUNNING for c in current.chunks)
        if not continued:
            plan = self.scheduler.schedule()
            for seq in plan.failed:
                self._finish(seq, FinishReason.ERROR)
                outputs.append(make_output(seq))
            if not plan.chunks:
                return outputs
            current = self._launch(plan.chunks)
        queued = self._inflight = self._continue(current)
        if continued or (queued is not None and queued.admitted):
            # schedule() was not called, or the queued step admitted requests since: loads follow the queue
            self.scheduler.plan_adapter_loads()
        if continued:
            self.scheduler.note_step(0)
        for seq in queued.failed if queued is not None else ():   # their adapter failed when admitted
            self._finish(seq, FinishReason.ERROR)
            outputs.append(make_output(seq))
        outputs += self._postprocess(current)
        chunks = current.chunks
        self.stats["steps"] += 1
        self.stats["graph_steps"] += int(current.graph is not None)
        self.stats["mixed_graph_steps"] += int(current.graph is not None and current.graph[1] > 0)
        self.stats["overlapped_steps"] += int(self._inflight is not None)
        names = {c.seq.adapter for c in chunks}
        self.last_step = StepInfo(len(chunks), sum(c.num_tokens for c in chunks),
                                  tuple(sorted(names, key=lambda a: (a is not None, a or ""))),
                                  is_decode(chunks), current.graph is not None,
                                  time.perf_counter() - start, current.span,
                                  sum(c.start + c.num_tokens for c in chunks))
        return outputs

    def _launch(self, chunks: list[ScheduledChunk], inputs=None) -> "Launched":
        pending, graph, span = self.runner.launch(chunks, inputs, loads_urgent=self.scheduler.waiting_on_adapters)
        return Launched(chunks, pending, graph, span)

    def _continue(self, current: "Launched") -> "Launched | None":
        """Queue the next step of `current`'s sequences now, if the scheduler would run their decodes
        next: every chunk ends its sequence, every running sequence is in it, and the KV blocks for one
        more token each are free (no preemption happens here). Waiting requests the scheduler admits
        now join it (`Scheduler.admit_beside`), unless `overlap_admissions` is off: then a step that
        could admit one is left to `schedule`."""
        if not all(c.needs_logits for c in current.chunks):
            return None
        in_step = {id(c.seq) for c in current.chunks}
        if any(id(s) not in in_step for s in self.scheduler.running):
            return None  # a running prompt got no budget this step: the scheduler must see it next
        rows, chunks, leaving = [], [], 0
        for row, c in enumerate(current.chunks):
            seq = c.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            # sequences that end by length with this token are left out (their row would be wasted)
            if seq.num_output_tokens + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= self.max_model_len:
                leaving += 1
                continue
            rows.append(row)
            chunks.append(ScheduledChunk(seq, 1, start=seq.num_tokens, needs_logits=True))
        if not chunks:
            return None
        need = sum(self.blocks.missing(c.seq, c.start + 1) for c in chunks)
        if need > self.blocks.num_free:
            return None
        beside = self.config.overlap_admissions
        if not beside and self._admissible_waiting(need):
            return None
        for c in chunks:
            self.blocks.grow(c.seq, c.start + 1)
        admitted = self.scheduler.admit_beside(len(chunks), leaving) if beside else None
        if admitted is not None:
            self.stats["overlapped_admissions"] += bool(admitted.chunks)
            chunks += admitted.chunks   # after the decodes: the sampled tokens feed the first len(rows) rows
        index = torch.tensor(rows, dtype=torch.long).to(self.runner.device, non_blocking=True)
        launched = self._launch(chunks, (current.pending.tokens, index))
        if admitted is not None:
            launched.admitted, launched.failed = bool(admitted.chunks), admitted.failed
        return launched

    def _admissible_waiting(self, extra_blocks: int = 0) -> bool:
        """Would the scheduler admit a waiting request now? (Then it runs next, not a continuation.)
        Mirrors its rules: adapters not on the GPU are skipped until aged; the first request it
        reaches must fit in the free KV blocks (after `extra_blocks` for the continuation; `Scheduler.fits`)."""
        sched, now = self.scheduler, time.monotonic()
        if not sched.waiting or len(sched.running) >= self.config.max_num_seqs:
            return False
        if not sched.may_admit(now, self.config.max_num_batched_tokens - len(sched.running)):
            return False  # the latency/throughput setting holds new prompts back for now
        for seq in sched.waiting:
            if seq.adapter is not None:
                if seq.adapter not in self.adapters or self.adapters.error(seq.adapter) is not None:
                    return True   # the scheduler fails it at once
                if not self.adapters.is_resident(seq.adapter):
                    if now - seq.times.arrival >= self.config.max_queue_skip_ms / 1000:
                        return False  # aged: it blocks the queue until its adapter lands
                    continue
            return sched.fits(seq, extra_blocks)
        return False

    def _postprocess(self, launched: "Launched") -> list[RequestOutput]:
        sampled = launched.pending.result()
        now = time.monotonic()
        outputs, row = [], -1
        for chunk in launched.chunks:
            seq = chunk.seq
            row += int(chunk.needs_logits)
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted, or finished by the step before (an overlapped row): nothing to keep
            seq.num_cached = chunk.start + chunk.num_tokens
            if seq.num_output_tokens == 0:
                self.stats["tokens_prefilled"] += chunk.num_tokens
            if not chunk.needs_logits:
                continue
            if not sampled.finite[row]:  # NaN/inf logits: this request's output cannot be trusted
                seq.error = "the model produced non-finite logits (NaN or inf) for this request"
                self._finish(seq, FinishReason.ERROR)
                outputs.append(make_output(seq))
                continue
            token = sampled.token_ids[row]
            if seq.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[row])
            seq.token_ids.append(token)
            self.stats["tokens_generated"] += 1
            if seq.times.first_token is None:
                seq.times.first_token = now
            reason = stop_reason(seq, token, self.eos_token_ids, self.max_model_len)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(make_output(seq))
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
        self._requests.pop(seq.request_id, None)

    def close(self) -> None:
        """Stop the adapter threads and give the GPU memory back."""
        self._inflight = None
        self.runner.close()
        if self._frozen:   # the last engine to close unfreezes: cycles among its objects may be collected
            release_heap()
            self._frozen = False
