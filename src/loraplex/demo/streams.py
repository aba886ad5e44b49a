"""What `loraplex demo` shows, without the terminal UI: the panes' specs, the engine's batches as an observer
sees them, and the plain-text mode for pipes and CI (`run_plain`: one line per finished generation, then a
summary line; no escape codes). The terminal UI (tui.py) builds on the same pieces.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from ..sampling import SamplingParams


class Generator(Protocol):
    """What the demo needs of an engine, as `AsyncEngine` has it: outputs with `.new_text`, `.new_token_ids`,
    `.finished`, `.finish_reason` and `.error`."""
    def generate(self, prompt: str, params: SamplingParams | None, adapter: str | None) -> AsyncIterator[Any]: ...


@dataclass
class PaneSpec:
    title: str
    adapter: str | None   # None: the base model alone
    prompt: str


@dataclass(frozen=True)
class StepSnapshot:
    """The engine's batches as the observer last saw them."""
    steps: int = 0                            # engine steps that ran
    batch_size: int = 0                       # sequences in the last step (0 once the engine is idle)
    adapters: tuple[str | None, ...] = ()     # distinct adapters in the last step (None: base)
    max_batch_size: int = 0                   # the largest batch so far
    widest: tuple[str | None, ...] = ()       # the most distinct adapters seen running together


def adapter_label(adapter: str | None) -> str:
    return "base" if adapter is None else adapter


# control characters (but newline and tab) would move the terminal's cursor or ring its bell: shown as �
_CONTROLS = {c: "\ufffd" for c in [*range(0x20), *range(0x7f, 0xa0)] if c not in (0x09, 0x0a)}


def printable(text: str) -> str:
    """`text` as a pane shows it: control characters other than newline and tab become U+FFFD."""
    return text.translate(_CONTROLS)


class StepMonitor:
    """The engine's observer: call it on the engine's thread after each step; `snapshot()` from any thread.
    A step's adapters are the ones its StepInfo names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._snap = StepSnapshot()
        self._seen = None   # engine thread only: the last StepInfo counted

    def __call__(self, engine) -> None:
        step = engine.last_step
        if step is None or step is self._seen:   # a step that waited on an adapter load, or an idle tick
            if not engine.has_unfinished():      # (which leaves last_step as the last step left it)
                with self._lock:
                    self._snap = dataclasses.replace(self._snap, batch_size=0, adapters=())
            return
        self._seen, adapters = step, step.adapters
        with self._lock:
            s = self._snap
            self._snap = StepSnapshot(s.steps + 1, step.num_seqs, adapters, max(s.max_batch_size, step.num_seqs),
                                      adapters if len(adapters) > len(s.widest) else s.widest)

    def snapshot(self) -> StepSnapshot:
        with self._lock:
            return self._snap


def one_line(text: str) -> str:
    """`text` quoted on one line, JSON-style: newlines, tabs and control characters (escape codes too) escaped."""
    return json.dumps(text, ensure_ascii=False)


def describe_generation(spec: PaneSpec, text: str, tokens: int, seconds: float, finish_reason: str | None,
                        error: str | None) -> str:
    """One line for one finished generation of one pane: what plain mode prints, and `demo --once` at the end."""
    head = f"{spec.title} · adapter {adapter_label(spec.adapter)} · {tokens} tokens"
    if seconds > 0:
        head += f" · {tokens / seconds:.1f} tok/s"
    if error is not None:
        return f"{head} · error: {one_line(error)}"
    return f"{head} · {finish_reason or 'stopped'}: {one_line(spec.prompt + text)}"


def describe_batches(snap: StepSnapshot, tokens: int, seconds: float) -> str:
    """The summary line: tokens from all streams, and how the engine batched them."""
    rate = f" ({tokens / seconds:.1f} tok/s)" if seconds > 0 else ""
    line = f"all streams: {tokens} tokens in {seconds:.1f} s{rate}"
    if snap.steps:
        line += (f"; {snap.steps} engine steps, up to {snap.max_batch_size} sequences in one; in one step "
                 f"together: {', '.join(adapter_label(a) for a in snap.widest)}")
    return line


async def run_plain(engine: Generator, panes: list[PaneSpec], params: SamplingParams, *, loop_forever: bool = False,
                    monitor: StepMonitor | None = None, out: TextIO | None = None, pause_s: float = 1.5) -> int:
    """Every pane's stream at once through `engine`, in plain text: a line per finished generation (as each
    finishes), then, once every stream has ended (never, with `loop_forever`, until cancelled), a summary line.
    Returns 0, or 1 if a stream failed."""
    out = out if out is not None else sys.stdout
    if not panes:
        raise ValueError("run_plain needs at least one PaneSpec")
    start = time.monotonic()
    total = 0

    def say(line: str) -> None:
        print(line, file=out, flush=True)   # a pipe is block-buffered: each line as it comes

    async def drive(spec: PaneSpec) -> bool:
        nonlocal total
        while True:
            text, tokens, finish, error = "", 0, None, None
            t0 = time.monotonic()
            try:
                async for o in engine.generate(spec.prompt, params, adapter=spec.adapter):
                    text += o.new_text
                    tokens += len(o.new_token_ids)
                    if o.finished:
                        finish = o.finish_reason
                        if finish == "error":
                            error = o.error or "the request failed"
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 -- refused (unknown adapter, prompt too long) or a dead engine
                error = f"{type(e).__name__}: {e}"
            total += tokens
            say(describe_generation(spec, text, tokens, time.monotonic() - t0, finish, error))
            if error is not None:
                return False
            if not loop_forever:
                return True
            await asyncio.sleep(pause_s)

    ok = await asyncio.gather(*(drive(spec) for spec in panes))
    snap = monitor.snapshot() if monitor is not None else StepSnapshot()
    say(describe_batches(snap, total, time.monotonic() - start))
    return 0 if all(ok) else 1
