"""The offline API: `LLM(model, adapters={...}).generate(prompts, params, adapter=...)`."""
from __future__ import annotations

import itertools
import time
import weakref
from pathlib import Path
from typing import Mapping, Sequence

from tqdm.auto import tqdm

from .adapters.composition import AdapterRef, Composition
from .config import EngineConfig
from .engine.engine import Engine
from .engine.outputs import RequestOutput
from .sampling import SamplingParams

Prompt = str | Sequence[int]


class LLM:
    """Many prompts, each with its own adapter, several adapters with weights, or none, through one engine.

        llm = LLM("path/to/llama", adapters={"sql": "adapters/sql", "chat": "adapters/chat"})
        outs = llm.generate(["SELECT", "Hi"], SamplingParams(max_tokens=64), adapter=["sql", "chat"])
        outs = llm.generate(["SELECT"], adapter={"sql": 0.7, "chat": 0.3})   # both adapters, weighted

    `engine_settings` are `EngineConfig` fields (max_num_seqs, gpu_memory_utilization, …).

    A context manager: `with LLM(...) as llm:` closes the engine when the block ends. An LLM that is never
    closed is closed when it is garbage-collected, or else when the interpreter exits, so a script that
    never calls `close()` still ends cleanly.
    """

    def __init__(self, model: str | Path, adapters: dict[str, str | Path] | None = None, **engine_settings) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model, **engine_settings), adapters)
        self._ids = itertools.count()
        # Runs once: at close(), when this object is collected, or at exit (weakref.finalize's atexit hook),
        # whichever comes first. Closing unfreezes the heap the engine froze (engine/gc_heap.py), so that
        # the interpreter's shutdown collects the kernels' compiled objects like any others; left frozen,
        # Triton's nanobind objects outlive it and nanobind reports them as leaked.
        self._finalizer = weakref.finalize(self, Engine.close, self.engine)

    def close(self) -> None:
        """Stop the adapter loader threads and give the engine's memory back; calling it again does nothing."""
        self._finalizer()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, adapter: AdapterRef | Sequence[AdapterRef] = None, *,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the prompts' order. A prompt is a string or a
        list of token ids. `sampling_params` and `adapter` are one for all, or a list with one per prompt. An
        adapter is a name (an adapter, or a composition named with `engine.add_composition`), a {name: weight}
        mapping of up to 4 adapters whose weighted LoRAs add up (PEFT's `add_weighted_adapter(...,
        combination_type="cat")`), a `Composition`, or None for the base model."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and
                                        isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params", SamplingParams)
        adapters = self._per_prompt(adapter, len(prompts), "adapter", (str, Mapping, Composition))
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        submitted = []
        try:
            for rid, prompt, p, a in zip(ids, prompts, params, adapters):
                self.engine.add_request(rid, prompt, p, a)  # every bad prompt is refused before any runs
                submitted.append(rid)
        except Exception:
            for rid in submitted:
                self.engine.abort(rid)
            raise
        show = use_tqdm if use_tqdm is not None else len(prompts) > 1
        done: dict[str, RequestOutput] = {}
        with tqdm(total=len(prompts), desc="generating", unit="req", disable=not show) as bar:
            try:
                while len(done) < len(prompts):
                    outputs = self.engine.step()
                    for out in outputs:
                        if out.finished and out.request_id in ids:
                            done[out.request_id] = out
                            bar.update(1)
                    if self.engine.last_step is None and not outputs:
                        time.sleep(0.0005)   # nothing could run: waiting on an adapter load
            except BaseException:
                for rid in ids:
                    if rid not in done:
                        self.engine.abort(rid)
                raise
        return [done[rid] for rid in ids]

    @staticmethod
    def _per_prompt(value, n: int, name: str, kind: type | tuple[type, ...]) -> list:
        if value is None or isinstance(value, kind):
            return [value] * n
        if not isinstance(value, Sequence):
            kinds = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"{name} must be a {kinds}, None, or a list with one per prompt")
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
