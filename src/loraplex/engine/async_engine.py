"""`AsyncEngine`: the engine on its own thread, for asyncio callers (the HTTP server).

    engine = AsyncEngine(EngineConfig(...), adapters={...})
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), adapter={"chat": 0.7, "formal": 0.3}):
        print(out.new_text, end="")

Submissions and aborts are queued to the worker thread, which applies them between steps;
outputs come back through each request's asyncio queue. Leaving the `async for` early (or
cancelling the task) aborts the request, so its KV blocks and adapter pin are freed at once.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable, Sequence

from ..adapters.composition import AdapterRef, Composition
from ..config import EngineConfig
from ..sampling import SamplingParams
from .engine import Engine
from .outputs import RequestOutput

log = logging.getLogger("loraplex.engine")


class EngineDeadError(RuntimeError):
    """The engine's worker stopped on an error; no request can be served."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, adapters: dict[str, str | Path] | None = None, *,
                 engine: Engine | None = None, observer: Callable[[Engine], None] | None = None) -> None:
        self.engine = engine if engine is not None else Engine(config, adapters)
        # called on the worker thread after every step and every idle tick (~20 per second), where the
        # engine's state may be read (metrics); its errors are logged, never fatal
        self.observer = observer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # request id → its stream; an entry left by its reader stays (closing) until the worker has
        # applied the abort, so the id cannot be reused while the old request may still deliver
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()   # liveness checks and queueing vs the worker's final drain
        self._closed = False
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) -----------------------------------------------------------
    async def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     adapter: AdapterRef = None, request_id: str | None = None) -> str:
        """Queue a request and return its id; raises (ValueError / AdapterError) if it is refused. `adapter` as
        `Engine.add_request` takes it: a name (an adapter or a named composition), a {name: weight} mapping, a
        Composition, or None."""
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        with self._lock:  # the worker's final drain takes the lock: nothing queued here is ever lost
            self._check_alive()
            if request_id is None:
                request_id = f"req-{next(self._ids)}"
                while request_id in self._streams:  # a caller may have chosen a name of this form
                    request_id = f"req-{next(self._ids)}"
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already running")
            entry = self._streams[request_id] = _Stream(loop, asyncio.Queue())
            self._commands.put(("add", request_id, prompt, params, adapter, loop, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException as e:
            if isinstance(e, (ValueError, EngineDeadError)):  # refused: nothing runs under this id
                self._pop_stream(request_id, entry)
            else:  # cancelled: the request may be queued; the worker frees the id once it is aborted
                entry.closing = True
                self.abort(request_id)
            raise
        return request_id

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are made; the last one has `finished` set."""
        entry = self._streams.get(request_id)
        if entry is None or entry.closing:
            raise ValueError(f"unknown request {request_id!r}")
        outputs = entry.outputs
        finished = False
        try:
            while True:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"the engine stopped: {item!r}") from item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if finished:
                self._pop_stream(request_id, entry)
            else:   # the caller left early or was cancelled: the worker drops the entry once aborted
                entry.closing = True
                self.abort(request_id)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       adapter: AdapterRef = None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = await self.submit(prompt, params, adapter, request_id)
        async with contextlib.aclosing(self.stream(request_id)) as outputs:  # leaving early aborts at once
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Abort from any thread; takes effect before the engine's next step."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        """Abort a submitted request whose stream nobody will read (call on its submitter's loop);
        its id is free again once the abort has been applied."""
        entry = self._streams.get(request_id)
        if entry is not None:
            entry.closing = True
        self.abort(request_id)

    def run_on_engine(self, fn, timeout: float | None = 60.0):
        """Call `fn(engine)` on the worker thread between steps (e.g. adapter registration); returns its result."""
        done = threading.Event()
        box: list = []
        with self._lock:
            self._check_alive()
            self._commands.put(("call", fn, box, done))
        self._wake.set()
        waited = 0.0
        while not done.wait(0.05):
            waited += 0.05
            self._check_alive()
            if timeout is not None and waited >= timeout:
                raise TimeoutError("the engine did not answer in time")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[1]

    # Named compositions and adapter removal, applied between steps on the worker thread (`run_on_engine`: these
    # block the caller until then; from a coroutine, call them in a thread). Errors are the engine's.
    def add_composition(self, name: str, composition: Composition, timeout: float | None = 60.0) -> None:
        """`Engine.add_composition`: name a composition of registered adapters."""
        self.run_on_engine(lambda engine: engine.add_composition(name, composition), timeout)

    def remove_composition(self, name: str, timeout: float | None = 60.0) -> None:
        """`Engine.remove_composition`."""
        self.run_on_engine(lambda engine: engine.remove_composition(name), timeout)

    def remove_adapter(self, name: str, timeout: float | None = 60.0) -> None:
        """`Engine.remove_adapter`: refused (AdapterError) while a named composition uses the adapter."""
        self.run_on_engine(lambda engine: engine.remove_adapter(name), timeout)

    def compositions(self) -> dict[str, Composition]:
        """The named compositions now (read directly: safe from any thread, never waits for a step)."""
        return self.engine.compositions()

    def shutdown(self) -> None:
        """Stop the worker; open streams end with EngineDeadError, queued submissions are refused.
        Calling it again does nothing."""
        if self._closed:
            return
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        with self._lock:
            self._closed = True
            self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # ---- worker thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        if self.engine.runner.device.type == "cuda":
            import torch
            torch.cuda.set_device(self.engine.runner.device)   # this thread launches on the engine's GPU
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._observe()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                self._observe()
                if self.engine.last_step is None and not outputs:
                    self._wake.wait(0.0005)   # nothing could run: waiting on an adapter load
                    self._wake.clear()
        except BaseException as e:  # a bug or a device failure: fail every open stream, loudly
            log.exception("engine worker stopped")
            with self._lock:
                self.error = e
                self._fail_all(e)

    def _observe(self) -> None:
        if self.observer is None:
            return
        try:
            self.observer(self.engine)
        except Exception:
            log.exception("the engine observer failed")

    def _fail_all(self, error: BaseException) -> None:
        """End every open stream and refuse every queued command with `error`."""
        for request_id in list(self._streams):
            self._deliver(request_id, error)
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                _, request_id, _, _, _, loop, accepted = cmd
                dead = error if isinstance(error, EngineDeadError) else \
                    EngineDeadError(f"the engine stopped: {error!r}")
                _call_soon(loop, _settle, accepted, dead)
            elif cmd[0] == "call":
                cmd[2][:] = [EngineDeadError(f"the engine stopped: {error!r}")]
                cmd[3].set()

    def _queued_commands(self):
        while True:
            try:
                yield self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply_commands(self) -> None:
        for cmd in self._queued_commands():
            if cmd[0] == "add":
                _, request_id, prompt, params, adapter, loop, accepted = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, adapter)
                except Exception as e:  # refused: only this caller hears of it
                    _call_soon(loop, _settle, accepted, e)
                else:
                    if not _call_soon(loop, _settle, accepted, None):  # the caller's loop is gone
                        self.engine.abort(request_id)
                        entry = self._streams.get(request_id)
                        if entry is not None:
                            self._pop_stream(request_id, entry)
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                entry = self._streams.get(cmd[1])
                if entry is not None and entry.closing:
                    self._pop_stream(cmd[1], entry)   # its reader left: the id is free again
                elif out is not None:
                    self._deliver(cmd[1], out)
            elif cmd[0] == "call":
                _, fn, box, done = cmd
                try:
                    box[:] = [None, fn(self.engine)]
                except Exception as e:
                    box[:] = [e]
                done.set()

    def _deliver(self, request_id: str, item) -> None:
        entry = self._streams.get(request_id)
        if entry is not None and not entry.closing:
            if not _call_soon(entry.loop, entry.outputs.put_nowait, item):  # the caller's loop is closed
                self._pop_stream(request_id, entry)

    def _pop_stream(self, request_id: str, entry: "_Stream") -> None:
        if self._streams.get(request_id) is entry:
            del self._streams[request_id]


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue
    closing: bool = False


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """`loop.call_soon_threadsafe`; False if the loop is closed (its caller is gone)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:
        return False


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
