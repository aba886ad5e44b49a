"""`AsyncEngine`: the engine on its own thread, for asyncio callers (the HTTP server).

    engine = AsyncEngine(EngineConfig(...), adapters={...})
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), adapter="chat"):
        print(out.new_text, end="")

Submissions and aborts are queued to the worker thread, which applies them between steps;
outputs come back through each request's asyncio queue. Leaving the `async for` early (or
cancelling the task) aborts the request, so its KV blocks and adapter pin are freed at once.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from pathlib import Path
from typing import AsyncIterator, Sequence

from ..config import EngineConfig
from ..sampling import SamplingParams
from .engine import Engine
from .outputs import RequestOutput

log = logging.getLogger("loraplex.engine")


class EngineDeadError(RuntimeError):
    """The engine's worker stopped on an error; no request can be served."""


class AsyncEngine:
    def __init__(self, config: EngineConfig, adapters: dict[str, str | Path] | None = None, *,
                 engine: Engine | None = None) -> None:
        self.engine = engine if engine is not None else Engine(config, adapters)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._stop = False
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="loraplex-engine", daemon=True)
        self._thread.start()

    # ---- caller side (any event loop) -----------------------------------------------------------
    async def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     adapter: str | None = None, request_id: str | None = None) -> str:
        """Queue a request and return its id; raises (ValueError / AdapterError) if it is refused."""
        self._check_alive()
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._streams:  # a caller may have chosen a name of this form
                request_id = f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already running")
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()
        self._streams[request_id] = (loop, asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params, adapter, loop, accepted))
        self._wake.set()
        try:
            await accepted
        except BaseException as e:
            self._streams.pop(request_id, None)
            if not isinstance(e, (ValueError, EngineDeadError)):  # cancelled: the request may be queued
                self.abort(request_id)
            raise
        return request_id

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they are made; the last one has `finished` set."""
        if request_id not in self._streams:
            raise ValueError(f"unknown request {request_id!r}")
        _, outputs = self._streams[request_id]
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
            self._streams.pop(request_id, None)
            if not finished:   # the caller left early or was cancelled
                self.abort(request_id)

    async def generate(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                       adapter: str | None = None, request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = await self.submit(prompt, params, adapter, request_id)
        async for out in self.stream(request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Abort from any thread; takes effect before the engine's next step."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    def run_on_engine(self, fn, timeout: float | None = 60.0):
        """Call `fn(engine)` on the worker thread between steps (e.g. adapter registration); returns its result."""
        self._check_alive()
        done = threading.Event()
        box: list = []
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

    def shutdown(self) -> None:
        """Stop the worker; open streams end with EngineDeadError, queued submissions are refused."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=30)
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine.close()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error!r}")
        if not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    # ---- worker thread ----------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if not outputs:
                    self._wake.wait(0.0005)   # waiting on an adapter load
                    self._wake.clear()
        except BaseException as e:  # a bug or a device failure: fail every open stream, loudly
            log.exception("engine worker stopped")
            self.error = e
            self._fail_all(e)

    def _fail_all(self, error: BaseException) -> None:
        """End every open stream and refuse every queued command with `error`."""
        for request_id in list(self._streams):
            self._deliver(request_id, error)
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, _, _, _, loop, accepted = cmd
                dead = error if isinstance(error, EngineDeadError) else \
                    EngineDeadError(f"the engine stopped: {error!r}")
                _call_soon(loop, _settle, accepted, dead)
            elif cmd[0] == "call":
                cmd[2][:] = [EngineDeadError(f"the engine stopped: {error!r}")]
                cmd[3].set()

    def _apply_commands(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, request_id, prompt, params, adapter, loop, accepted = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, adapter)
                except Exception as e:  # refused: only this caller hears of it
                    _call_soon(loop, _settle, accepted, e)
                else:
                    if not _call_soon(loop, _settle, accepted, None):  # the caller's loop is gone
                        self.engine.abort(request_id)
                        self._streams.pop(request_id, None)
            elif cmd[0] == "abort":
                out = self.engine.abort(cmd[1])
                if out is not None:
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
        if entry is not None:
            loop, outputs = entry
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:  # the caller's loop is closed
                self._streams.pop(request_id, None)


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
