"""`ClusterEngine`: what the server calls on its engine (`AsyncEngine`'s methods), over the engine replicas.

The ingress runs loraplex's own FastAPI app (server/app.py) around this object, so every route, check and error is
the single-GPU server's. A request here:
1. is checked as the engine would check it (prompt, sampling params, adapters: `NamedCompositions.resolve` over the
   cluster's registry), so a bad one is refused at submit with the engine's own error;
2. is placed by the routing policy on a replica, or waits in the bounded router queue (placement.py; full: 429).
   The request router (router.py) delivers each job to the replica placed;
3. runs as a `ClusterRequest` (cluster_request.py): attempts on replicas, streamed back, resumed elsewhere by
   re-prefill when a replica migrates it or dies.

The policy runs in the ingress, in one place that sees both new and waiting requests, rather than in each of Ray's
per-request routing tasks, which retry with backoff and keep no order between waiting requests: the queue is first
come, first served (with aging), and a placed job names its replica.
"""
from __future__ import annotations

import asyncio
import contextlib
import contextvars
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace

from ray.exceptions import RayActorError

from ..adapters import AdapterError
from ..adapters.composition import AdapterRef, Composition
from ..engine.async_engine import EngineDeadError
from ..engine.compositions import NamedCompositions
from ..engine.outputs import RequestOutput
from ..engine.requests import check_request
from ..sampling import SamplingParams
from ..server.errors import APIError
from .cluster_adapters import ClusterCore
from .cluster_metrics import ClusterMetrics
from .cluster_request import ClusterRequest
from .messages import Control, Job
from .placement import Placement, Waiter
from .routing import QueueFull
from .view import ClusterView

log = logging.getLogger("loraplex.cluster")

ALIVE_CHECK_S = 0.5        # how often a job whose replica has not answered yet checks that it still runs


class ReplicaGone(RuntimeError):
    """The replica of a job left the cluster before answering it."""


class ClusterEngine:
    def __init__(self, handle, view: ClusterView, core: ClusterCore, metrics: ClusterMetrics, *,
                 router_queue: int, max_retries: int = 3) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.handle, self.view, self.engine, self.metrics = handle, view, core, metrics
        self.placement = Placement(view, router_queue, core.adapters.sources, metrics.set_queue)
        self.max_retries = max_retries
        self.named = NamedCompositions(core.config, core.adapters)   # the named compositions
        self.observer = None          # (the server sets one; replicas report through the view instead)
        self.error: BaseException | None = None
        self._requests: dict[str, ClusterRequest] = {}
        self._ids = itertools.count()
        self._closed = False

    # ---- AsyncEngine's interface ------------------------------------------------------------------
    async def submit(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                     adapter: AdapterRef = None, request_id: str | None = None) -> str:
        """Check and place a request (module docstring); its id. ValueError / AdapterError as the engine raises
        them; APIError 429 when no replica has room and the router queue is full."""
        self._check_alive()
        req = self._new_request(prompt, params, adapter, request_id)
        try:
            first = self.placement.admit(req)
        except QueueFull as e:
            self.metrics.rejected()
            raise APIError(429, f"no replica has room and the router queue is full ({e.max_waiting} requests "
                                f"waiting); retry shortly", code="queue_full", headers={"Retry-After": "1"}) from None
        self._requests[req.request_id] = req
        req.task = asyncio.create_task(self._drive(req, first))
        return req.request_id

    async def stream(self, request_id: str) -> AsyncIterator[RequestOutput]:
        req = self._requests.get(request_id)
        if req is None or req.closing:
            raise ValueError(f"unknown request {request_id!r}")
        finished = False
        try:
            while True:
                item = await req.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:   # the reader left: stop it wherever it runs
                self.cancel(request_id)
            elif self._requests.get(request_id) is req:
                del self._requests[request_id]

    async def generate(self, prompt, params=None, adapter: AdapterRef = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        request_id = await self.submit(prompt, params, adapter, request_id)
        async with contextlib.aclosing(self.stream(request_id)) as outputs:
            async for out in outputs:
                yield out

    def abort(self, request_id: str) -> None:
        """Stop a request; its reader gets a last output, finished with "abort"."""
        req = self._requests.get(request_id)
        if req is not None and not req.finished:
            req.task.cancel()
            req.outputs.put_nowait(req.ended("abort"))

    def cancel(self, request_id: str) -> None:
        """Stop a request nobody reads."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            req.closing = True
            req.task.cancel()

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.placement.close()
        for req in list(self._requests.values()):
            req.task.cancel()
            req.outputs.put_nowait(EngineDeadError("the engine was shut down"))

    @property
    def is_running(self) -> bool:
        return not self._closed and self.error is None

    # named compositions: checked here (the cluster's registry); requests carry their composition to replicas
    def add_composition(self, name: str, composition: Composition, timeout: float | None = 60.0) -> None:
        self.named.add(name, composition)

    def remove_composition(self, name: str, timeout: float | None = 60.0) -> None:
        self.named.remove(name)

    def remove_adapter(self, name: str, timeout: float | None = 60.0) -> None:
        users = self.named.using(name)
        if users:
            raise AdapterError(f"adapter {name!r} is a member of the composition(s) {', '.join(users)}: "
                               f"remove them first")
        self.engine.adapters.unregister(name)

    def compositions(self) -> dict[str, Composition]:
        return self.named.snapshot()

    # ---- placement --------------------------------------------------------------------------------
    def _new_request(self, prompt, params, adapter, request_id) -> ClusterRequest:
        """Engine.add_request's checks, against the replicas' model and the cluster's adapters."""
        core = self.engine
        params, text, ids = check_request(prompt, params, core.tokenizer, core.model_config.vocab_size,
                                          core.max_model_len)
        composition, label = self.named.resolve(adapter)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self._requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already running")
        given = composition.single or composition if composition is not None else None
        return ClusterRequest(request_id, ids, text, params, given, composition, label)

    # ---- one request, attempt after attempt -------------------------------------------------------
    async def _drive(self, req: ClusterRequest, first: Job | Waiter) -> None:
        retries = 0
        try:
            job = first if isinstance(first, Job) else await self.placement.wait(first)
            while True:
                outcome, replica = await self._attempt(req, job)
                if outcome == "done":
                    return
                if outcome == "migrated":
                    self.metrics.migrated(replica)
                else:
                    retries += 1
                    self.metrics.retried(replica)
                    if retries > self.max_retries:
                        self._deliver(req, req.ended("error", f"the request failed on {retries} replicas "
                                                              f"that stopped while serving it"))
                        return
                req.moves += 1
                job = await self.placement.moved(req, replica, migrated=outcome == "migrated")
        except asyncio.CancelledError:
            raise
        except Exception as e:   # a bug, or Ray failing in a way not foreseen: this request fails, loudly
            log.exception("request %s failed at the ingress", req.request_id)
            self._deliver(req, req.ended("error", f"the cluster failed to serve the request: {e!r}"))

    async def _attempt(self, req: ClusterRequest, job: Job) -> tuple[str, str | None]:
        """Run `job`: ("done" | "migrated" | "failed", the replica it ran on)."""
        replica, req.replica = job.target, job.target
        stream = _detached(self.handle.options(stream=True).generate.remote, job)
        try:
            replica = await self._header(stream, job.target)
            async for out in stream:
                if out.finished and out.finish_reason == "migrated":
                    if out.new_token_ids:   # (tokens are reported as made: none are left here in practice)
                        self._deliver(req, req.take(replace(out, finished=False, finish_reason=None)))
                    return "migrated", replica
                self._deliver(req, req.take(out))
                self.metrics.output(replica, req, out)
                if out.finished:
                    return "done", replica
            return "failed", replica    # the stream ended without a last output
        except (RayActorError, ReplicaGone) as e:   # the replica's process died (or cannot be reached)
            log.warning("replica %s failed while serving %s (%s): resuming it elsewhere", replica, job.key, e)
            self.view.mark_failed(replica)
            return "failed", replica
        except Exception as e:
            if isinstance(e, EngineDeadError) or isinstance(getattr(e, "cause", None), EngineDeadError):
                self.view.mark_failed(replica)
                return "failed", replica
            self._deliver(req, req.ended("error", _cause_text(e)))   # the replica refused it
            return "done", replica
        finally:
            with contextlib.suppress(Exception):
                stream.cancel()
            self.view.note_ended(replica)
            self.view.forget(job.key)
            self.placement.wake()

    async def _header(self, stream, target: str) -> str:
        """The replica's id, its stream's first item; fails the attempt if the replica left the cluster first."""
        first = asyncio.ensure_future(stream.__anext__())
        try:
            while True:
                done, _ = await asyncio.wait({first}, timeout=ALIVE_CHECK_S)
                if done:
                    return first.result()
                if target not in self.view.replica_ids():
                    raise ReplicaGone(f"replica {target} left the cluster before answering")
        finally:
            first.cancel()

    def _deliver(self, req: ClusterRequest, item: RequestOutput) -> None:
        if not req.closing:
            req.outputs.put_nowait(item)

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDeadError("the engine is shut down")

    # ---- control calls ------------------------------------------------------------------------------
    async def control(self, target: str, op: str, args=None, timeout: float = 60.0):
        """Call `op` on replica `target` (replica.py's op_* methods)."""
        return await asyncio.wait_for(_detached(self.handle.control.remote, Control(target, op, args)), timeout)


def _detached(remote, *args):
    """`remote(*args)` (a handle call) outside the HTTP request being served. Ray Serve gives a handle call the
    internal request id of the request it is made in, and its request router (Ray 2.60) pairs a replica it found
    with the pending call of that id: several calls pending at once under one id (a request's choices, a push to
    every replica) could each get the replica chosen for another. A fresh context gives each call its own id."""
    return contextvars.Context().run(remote, *args)


def _cause_text(e: BaseException) -> str:
    cause = getattr(e, "cause", None) or e
    return f"{type(cause).__name__}: {cause}"
