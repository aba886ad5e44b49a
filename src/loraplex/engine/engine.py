"""The engine: requests in, tokens out. One `step()` = schedule → run → postprocess.

Not thread-safe: one thread drives it (the offline `LLM` loop, or `AsyncEngine`'s worker).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence as Seq

from ..adapters import AdapterError
from ..config import EngineConfig
from ..sampling import SamplerOutput, SamplingParams
from .block_manager import BlockManager
from .model_runner import ModelRunner
from .outputs import RequestOutput, make_output
from .scheduler import ScheduledChunk, Scheduler
from .sequence import FinishReason, Sequence, SequenceStatus

log = logging.getLogger("loraplex.engine")


@dataclass
class StepInfo:
    """What the last step ran (for metrics and benchmarks)."""
    num_seqs: int
    num_tokens: int
    num_adapters: int      # distinct adapters in the step
    decode: bool           # every sequence fed one token
    graphed: bool          # replayed a CUDA graph
    seconds: float         # wall time of the whole step: schedule, run, sample, postprocess


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
        self.stats = {"steps": 0, "graph_steps": 0, "tokens_prefilled": 0, "tokens_generated": 0}
        for name, path in (adapters or {}).items():
            self.add_adapter(name, path)

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
        text_prompt, token_ids = self._tokenize(prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens; this engine serves at most "
                             f"{self.max_model_len} tokens per sequence (max_model_len), output included")
        if adapter is not None:
            if not isinstance(adapter, str) or adapter not in self.adapters:
                known = ", ".join(self.adapters.names()[:20]) or "none"
                raise AdapterError(f"unknown adapter {adapter!r} (registered: {known})")
            if self.adapters.error(adapter) is not None:
                raise AdapterError(f"adapter {adapter!r} failed to load: {self.adapters.error(adapter)}")
            self.adapters.prefetch(adapter)   # it loads while the request queues
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

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: give the prompt as token ids")
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, list(self.tokenizer.encode(prompt))
        try:
            ids = [int(t) for t in prompt]
            ok = all(isinstance(t, int) or type(t).__name__.startswith("int") for t in prompt)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"the prompt must be a string or a list of token ids, got {prompt!r:.80}")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(ids):
            if not 0 <= t < vocab:
                raise ValueError(f"prompt token {i} = {t} is outside the vocabulary [0, {vocab})")
        return None, ids

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
        """Schedule, run and postprocess one step; an output for every request that progressed."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        outputs = []
        for seq in plan.failed:
            self._finish(seq, FinishReason.ERROR)
            outputs.append(make_output(seq))
        if not plan.chunks:
            return outputs
        sampled, graphed = self.runner.execute(plan.chunks)
        outputs += self._postprocess(plan.chunks, sampled)
        self.stats["steps"] += 1
        self.stats["graph_steps"] += int(graphed)
        self.last_step = StepInfo(len(plan.chunks), plan.num_tokens,
                                  len({c.seq.adapter for c in plan.chunks if c.seq.adapter is not None}),
                                  plan.is_decode, graphed, time.perf_counter() - start)
        return outputs

    def _postprocess(self, chunks: list[ScheduledChunk], sampled: SamplerOutput) -> list[RequestOutput]:
        now = time.monotonic()
        outputs, row = [], 0
        for chunk in chunks:
            seq = chunk.seq
            needs_logits = chunk.needs_logits
            seq.num_cached += chunk.num_tokens
            if seq.num_output_tokens == 0:
                self.stats["tokens_prefilled"] += chunk.num_tokens
            if not needs_logits:
                continue
            token = sampled.token_ids[row]
            if seq.logprobs is not None:
                seq.logprobs.append(sampled.logprobs[row])
            row += 1
            seq.token_ids.append(token)
            self.stats["tokens_generated"] += 1
            if seq.times.first_token is None:
                seq.times.first_token = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            outputs.append(make_output(seq))
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        params = seq.params
        stop_str = seq.text.append(token) if seq.text is not None else None
        if stop_str is not None:
            seq.stop_reason = stop_str
            return FinishReason.STOP
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return FinishReason.STOP
        if not params.ignore_eos and token in self.eos_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.status is not SequenceStatus.FINISHED:
            self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
        self._requests.pop(seq.request_id, None)

    def close(self) -> None:
        self.adapters.close()
