"""The engine: requests in, tokens out. One `step()` = schedule → run → postprocess.

Not thread-safe: one thread drives it (the offline `LLM` loop, or `AsyncEngine`'s worker).
"""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Sequence as Seq

from ..adapters import AdapterError
from ..adapters.composition import AdapterRef, Composition
from ..config import EngineConfig
from ..sampling import SamplingParams
from .block_manager import BlockManager
from .compositions import NamedCompositions
from .gc_heap import freeze_heap, release_heap
from .model_runner import ModelRunner
from .outputs import RequestOutput, make_output
from .requests import check_request, stop_reason
from .scheduler import Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus
from .step_info import StepInfo
from .step_pipeline import Launched, StepPipeline

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
        self._compositions = NamedCompositions(config, self.adapters)
        self.last_step: StepInfo | None = None
        self.pipeline = StepPipeline(config, self.runner, self.scheduler, self.blocks)
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
        if name in self._compositions:
            raise AdapterError(f"adapter name {name!r} is already registered (a composition)")
        self.adapters.register(name, path)

    def remove_adapter(self, name: str) -> None:
        """Unregister an adapter (requests already running with it finish). Refused while a named composition
        uses it: remove those first."""
        users = self._compositions.using(name)
        if users:
            raise AdapterError(f"adapter {name!r} is a member of the composition(s) {', '.join(users)}: "
                               f"remove them first")
        self.adapters.unregister(name)

    def add_composition(self, name: str, composition: Composition) -> None:
        """Name a composition of registered adapters (a recipe: no weights are copied); requests then use the name
        as an adapter's. Refuses a name already used by an adapter or a composition, and members that are not
        registered adapters."""
        self._compositions.add(name, composition)

    def remove_composition(self, name: str) -> None:
        """Forget a named composition; requests already using it go on with it."""
        self._compositions.remove(name)

    def compositions(self) -> dict[str, Composition]:
        """The named compositions (a copy; safe to call from any thread)."""
        return self._compositions.snapshot()

    # ---- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Seq[int], params: SamplingParams | None = None,
                    adapter: AdapterRef = None) -> Sequence:
        """Queue a request; every problem with it is a ValueError now, never a failure later. `adapter`: an
        adapter's name, a named composition's, a {name: weight} mapping of up to 4 adapters (a Composition), or
        None for the base model. A malformed or too large composition is a ValueError, an unknown member or one that
        failed to load an AdapterError naming it (`NamedCompositions.resolve`)."""
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        params, text_prompt, token_ids = check_request(prompt, params, self.tokenizer, self.model_config.vocab_size,
                                                       self.max_model_len)
        # its loads are ordered by the scheduler's plan (queue order, into free slots), from the next step
        composition, label = self._compositions.resolve(adapter)
        seq = Sequence(request_id, token_ids, params, adapter=composition, prompt=text_prompt, adapter_label=label)
        if params.seed is not None:
            seq.generator = self.runner.new_generator(params.seed)
        if self.tokenizer is not None:
            from .detokenizer import OutputText
            seq.text = OutputText(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
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
        """Run one step: schedule → run → postprocess. An output for every request that progressed.

        The GPU runs one step ahead where it can: the step after this one is queued before this one's
        tokens reach the host, and the next call takes it instead of scheduling (`StepPipeline`)."""
        start = time.perf_counter()
        self.last_step = None   # stays None when nothing ran (callers may then wait a little)
        current, outputs = self._schedule()                        # what runs now, launched
        if current is None:
            return outputs
        outputs += self._fail(self.pipeline.queue_next(current))   # the GPU goes on to the next step
        outputs += self._postprocess(current)                      # while the host reads this one's tokens
        self._record(current, time.perf_counter() - start)
        return outputs

    def _schedule(self) -> tuple[Launched | None, list[RequestOutput]]:
        """The step that runs now, launched: the one queued ahead during the last step, else the scheduler's
        next (None when there is nothing to run); and the outputs of requests whose adapter failed."""
        current = self.pipeline.take()
        if current is not None:
            return current, []
        plan = self.scheduler.schedule()
        failed = self._fail(plan.failed)
        return (self.pipeline.launch(plan.chunks) if plan.chunks else None), failed

    def _record(self, current: Launched, seconds: float) -> None:
        graph, queued = current.graph, self.pipeline.queued
        self.stats["steps"] += 1
        self.stats["graph_steps"] += int(graph is not None)
        self.stats["mixed_graph_steps"] += int(graph is not None and graph[1] > 0)
        self.stats["overlapped_steps"] += int(queued is not None)
        self.stats["overlapped_admissions"] += int(queued is not None and queued.admitted)
        self.last_step = StepInfo.of(current.chunks, graph is not None, seconds, current.span)

    def _postprocess(self, launched: Launched) -> list[RequestOutput]:
        """Read the step's sample; cache its chunks, append each sampled token and end what stops."""
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

    def _fail(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """End requests whose adapter failed to load (their `error` says why)."""
        for seq in seqs:
            self._finish(seq, FinishReason.ERROR)
        return [make_output(seq) for seq in seqs]

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
        self._requests.pop(seq.request_id, None)

    def close(self) -> None:
        """Stop the adapter threads and give the GPU memory back."""
        self.pipeline.clear()
        self.runner.close()
        if self._frozen:   # the last engine to close unfreezes: cycles among its objects may be collected
            release_heap()
            self._frozen = False
