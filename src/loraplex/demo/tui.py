"""The `loraplex demo` terminal UI: one pane per stream, each with its own adapter, all served by one engine.

    monitor = StepMonitor()
    engine = AsyncEngine(config, adapters, observer=monitor)
    DemoApp(engine, [PaneSpec("base", None, "The "), PaneSpec("poet", "poet", "Roses ")], params, monitor=monitor).run()

Each pane streams `engine.generate(...)` as a task on the app's event loop: the requests are in flight together,
so the engine runs them in the same steps. `StepMonitor`, the engine's observer, records each step under a lock
on the engine's thread; a timer on the UI thread reads that snapshot ten times a second. With
`exit_when_done`, the app exits once every stream has ended (`loraplex demo --once`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import ClassVar

from textual.app import App, ComposeResult
from textual.containers import Grid, VerticalScroll
from textual.content import Content
from textual.widgets import Footer, Static

from ..sampling import SamplingParams
from .streams import (  # also imported from here by callers: PaneSpec, StepMonitor, printable
    Generator,
    PaneSpec,
    StepMonitor,
    StepSnapshot,
    adapter_label,
    describe_generation,
    printable,
)


class RateMeter:
    """Per-second rate of a growing count over the last `window` seconds."""

    def __init__(self, window: float = 2.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, count: float) -> float:
        self._samples.append((now, count))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window:
            self._samples.popleft()
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0


@dataclass
class StreamState:
    """One pane's stream; changed only on the UI's event loop."""
    text: str = ""                 # generated text of the current generation
    error: str | None = None
    status: str = "waiting"        # waiting | running | done | error | paused
    finish_reason: str | None = None
    tokens: int = 0                # tokens of the current generation
    total_tokens: int = 0          # over every generation of this pane
    runs: int = 0                  # generations started (a resume after a pause is not a new one)
    started: float = 0.0           # when the current generation started, moved later by its pauses
    ended: float | None = None     # when it last stopped generating (None: generating)
    dirty: bool = True             # the text changed since the pane last showed it

    def begin(self) -> None:
        self.text, self.error, self.finish_reason, self.tokens, self.ended = "", None, None, 0, None
        self.runs, self.dirty = self.runs + 1, True

    def rate(self, now: float) -> float:
        elapsed = (self.ended or now) - self.started
        return self.tokens / elapsed if elapsed > 0 else 0.0


@dataclass(frozen=True)
class DemoStats:
    """What the status bar shows, as of the last refresh."""
    tokens_per_s: float = 0.0     # generated tokens per second, all streams together
    total_tokens: int = 0
    steps_per_s: float = 0.0
    step: StepSnapshot = StepSnapshot()
    paused: bool = False

    def describe(self, observed: bool = True) -> str:
        batch = (f"batch {self.step.batch_size} seqs (max {self.step.max_batch_size}) · "
                 f"{len(self.step.adapters)} adapters in step: "
                 f"{', '.join(adapter_label(a) for a in self.step.adapters) or '-'} · "
                 f"{self.steps_per_s:.1f} steps/s · " if observed else "")
        return (f"{batch}{self.tokens_per_s:.1f} tok/s total · {self.total_tokens} tokens"
                + (" · PAUSED (p resumes)" if self.paused else ""))


class DemoApp(App):
    """Panes that stream at once through one engine; q quits, r restarts every stream, p pauses/resumes."""

    TITLE = "loraplex demo"
    ENABLE_COMMAND_PALETTE = False
    CSS = """
    #status { dock: top; height: 1; padding: 0 1; background: $primary; color: $text; }
    #panes { grid-gutter: 0 1; }
    .pane { border: round $accent; border-title-style: bold; padding: 0 1; }
    """
    BINDINGS: ClassVar = [("q", "quit", "quit"), ("r", "restart", "restart all"), ("p", "pause", "pause/resume")]

    def __init__(self, engine: Generator, panes: list[PaneSpec], params: SamplingParams, *,
                 loop_forever: bool = True, monitor: StepMonitor | None = None, pause_s: float = 1.5,
                 refresh_s: float = 0.1, exit_when_done: bool = False) -> None:
        super().__init__()
        if not panes:
            raise ValueError("DemoApp needs at least one PaneSpec")
        self.engine, self.panes, self.params = engine, list(panes), params
        self.loop_forever, self.monitor = loop_forever, monitor
        self.exit_when_done = exit_when_done and not loop_forever   # (looping streams never end)
        self.pause_s, self.refresh_s = pause_s, refresh_s
        self.streams = [StreamState() for _ in self.panes]
        self.stats = DemoStats()
        self.paused = False
        self._tasks: list[asyncio.Task | None] = [None] * len(self.panes)
        self._token_rate, self._step_rate = RateMeter(), RateMeter()

    # ---- what tests (and callers) read ------------------------------------------------------------
    def pane_text(self, i: int) -> str:
        """The text pane i shows: its prompt, the generated text, and an error line if it failed."""
        return self._bodies[i].content.plain

    def pane_footer(self, i: int) -> str:
        return self._boxes[i].border_subtitle or ""

    def describe(self, i: int) -> str:
        """Pane i's last generation on one line, as `loraplex demo --plain` prints it."""
        st = self.streams[i]
        seconds = (st.ended or time.monotonic()) - st.started if st.runs else 0.0
        return describe_generation(self.panes[i], st.text, st.tokens, seconds, st.finish_reason, st.error)

    @property
    def finished(self) -> bool:
        """Every stream is done or failed and none will start again (loop_forever off)."""
        return all(t is None or t.done() for t in self._tasks) and \
            all(s.status in ("done", "error") for s in self.streams)

    # ---- layout and refresh -----------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Static(id="status", markup=False)
        self._bodies = [Static("", markup=False) for _ in self.panes]
        self._boxes = [VerticalScroll(body, classes="pane") for body in self._bodies]
        for box, spec in zip(self._boxes, self.panes):
            box.border_title = Content(f"{spec.title} · adapter: {adapter_label(spec.adapter)}")
        yield Grid(*self._boxes, id="panes")
        yield Footer()

    def on_mount(self) -> None:
        self.query_one("#panes", Grid).styles.grid_size_columns = math.ceil(math.sqrt(len(self.panes)))
        self._status = self.query_one("#status", Static)
        self._refresh()
        self._timer = self.set_interval(self.refresh_s, self._refresh)
        for i in range(len(self.panes)):
            self._start(i)

    def on_unmount(self) -> None:   # quit by other means than q (ctrl+q, an error)
        for task in filter(None, self._tasks):
            task.cancel()

    def _refresh(self) -> None:
        now = time.monotonic()
        for i, (spec, st) in enumerate(zip(self.panes, self.streams)):
            pane = self._boxes[i]
            if st.dirty:
                st.dirty = False
                body = Content.styled(printable(spec.prompt), "dim") + Content(printable(st.text))
                if st.error is not None:
                    body += Content.styled(f"\n⚠ error: {printable(st.error)}", "bold red")
                self._bodies[i].update(body)
                pane.scroll_end(animate=False)
            state = f"done ({st.finish_reason})" if st.status == "done" and st.finish_reason else st.status
            pane.border_subtitle = Content(f"{st.tokens} tokens · {st.rate(now):.1f} tok/s · {state}")
        snap = self.monitor.snapshot() if self.monitor is not None else StepSnapshot()
        total = sum(s.total_tokens for s in self.streams)
        self.stats = DemoStats(self._token_rate.add(now, total), total, self._step_rate.add(now, snap.steps),
                               snap, self.paused)
        self._status.update(self.stats.describe(observed=self.monitor is not None))
        if self.exit_when_done and not self.paused and self.finished:
            self._timer.stop()
            self.exit()   # after this refresh: the panes show every stream's last text

    # ---- the streams ------------------------------------------------------------------------------
    def _start(self, i: int, resume: bool = False) -> None:
        self._tasks[i] = asyncio.create_task(self._drive(i, resume), name=f"demo-pane-{i}")

    async def _drive(self, i: int, resume: bool) -> None:
        """Pane i's generations: one, or one after another with a pause between (loop_forever)."""
        spec, st = self.panes[i], self.streams[i]
        while True:
            prompt, params = spec.prompt, self.params
            if resume and st.tokens < params.max_tokens:   # go on from the text so far
                prompt += st.text
                params = dataclasses.replace(params, max_tokens=params.max_tokens - st.tokens)
            else:
                st.begin()
            resume = False
            await self._generate(st, spec.adapter, prompt, params)
            if not self.loop_forever or st.status == "error":
                return
            await asyncio.sleep(self.pause_s)

    async def _generate(self, st: StreamState, adapter: str | None, prompt: str, params: SamplingParams) -> None:
        now = time.monotonic()   # the clock goes on from where it stopped (a resume) or starts (begin)
        st.status, st.started, st.ended = "running", now - (st.ended - st.started if st.ended else 0.0), None
        try:
            async for out in self.engine.generate(prompt, params, adapter=adapter):
                st.text += out.new_text
                st.tokens += len(out.new_token_ids)
                st.total_tokens += len(out.new_token_ids)
                st.dirty = True
                if out.finished:
                    st.finish_reason = out.finish_reason
                    if out.finish_reason == "error":
                        st.status, st.error = "error", out.error or "the request failed"
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 -- refused (unknown adapter, prompt too long) or a dead engine
            st.status, st.error = "error", f"{type(e).__name__}: {e}"
        finally:
            st.ended, st.dirty = time.monotonic(), True
        if st.status == "running":
            st.status = "done"

    async def _stop_all(self) -> None:
        tasks = [t for t in self._tasks if t is not None and not t.done()]
        for task in tasks:
            task.cancel()   # leaving a stream aborts its request in the engine
        await asyncio.gather(*tasks, return_exceptions=True)

    # ---- keys -------------------------------------------------------------------------------------
    async def action_quit(self) -> None:
        self._timer.stop()
        await self._stop_all()
        self.exit()

    async def action_restart(self) -> None:
        """Every pane starts a new generation of its prompt now (and the demo runs again if paused)."""
        await self._stop_all()
        self.paused = False
        for i, st in enumerate(self.streams):
            st.status = "waiting"
            self._start(i)

    async def action_pause(self) -> None:
        """Pause: abort the requests in flight (the engine goes idle). Resume: each interrupted pane goes on
        from its text so far (its prompt + text, re-tokenized); with loop_forever, the others start anew."""
        if not self.paused:
            self.paused = True
            running = [st.status == "running" for st in self.streams]
            await self._stop_all()
            for st, was_running in zip(self.streams, running):
                if was_running:
                    st.status = "paused"
                    st.dirty = True
            return
        self.paused = False
        for i, st in enumerate(self.streams):
            if st.status == "paused":
                self._start(i, resume=True)
            elif self.loop_forever and st.status != "error":
                self._start(i)
