"""`Placement`: where each request of the ingress goes, and the router queue where it waits for room.

A request is placed by the routing policy over the `ClusterView` (`routing.choose_replica`: consolidation,
adapter affinity, room) as soon as it arrives, unless requests are already waiting (first come, first served).
Otherwise it waits in the bounded `routing.RouterQueue` (full: `QueueFull`, which the server answers with 429).
Requests moving off a replica (migration, failover) wait in a list placed before the queue. Waiting requests
are placed whenever a request ends (`wake`) and every `DISPATCH_S`, the queue through `RouterQueue.pop_ready`
(in order, with aging), each placement counted before the next is chosen.

A placed request becomes a `Job` naming its replica, counted in the view at once (`note_sent`), so the next
placement sees it even before the replica's report does.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .cluster_request import ClusterRequest
from .messages import Job
from .routing import RouterQueue
from .view import ClusterView

log = logging.getLogger("loraplex.cluster")

DISPATCH_S = 0.02   # how often waiting requests look for room (besides each request's end)


@dataclass(eq=False)
class Waiter:
    request: ClusterRequest
    exclude: frozenset[str] = frozenset()
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class Placement:
    def __init__(self, view: ClusterView, router_queue: int, sources: Callable[[tuple[str, ...]], dict[str, str]],
                 on_queue: Callable[[int, int], None] = lambda queued, moving: None) -> None:
        self.view = view
        self.queue: RouterQueue[Waiter] = RouterQueue(router_queue)
        self.moving: deque[Waiter] = deque()
        self._sources, self._on_queue = sources, on_queue   # run-time adapters' folders; the queue's gauges
        self._wake = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def close(self) -> None:
        self._task.cancel()

    def wake(self) -> None:
        """Room may have freed (a request ended)."""
        self._wake.set()

    # ---- placing ------------------------------------------------------------------------------------
    def now(self, req: ClusterRequest, exclude: frozenset[str] = frozenset()) -> Job | None:
        """The request's job on the replica the policy chooses now; None when none has room."""
        target = self.view.choose(req.route(), exclude)
        return None if target is None else self._job(req, target, exclude)

    def admit(self, req: ClusterRequest) -> Job | Waiter:
        """A new request: its job now if none waits ahead of it and a replica has room, else its place in the
        router queue (QueueFull when that is full)."""
        job = self.now(req) if not self.queue and not self.moving else None
        if job is not None:
            return job
        waiter = Waiter(req)
        self.queue.push(waiter)
        return waiter

    async def moved(self, req: ClusterRequest, left: str | None, *, migrated: bool) -> Job:
        """A request that left replica `left` (migrated, or the replica failed): another replica with room now,
        else the first with room, waiting ahead of the queue. A migrated request never goes back to the replica
        short of memory it left; a failed replica's is kept out by the view until it reports ready again (so a
        one-replica cluster still resumes its requests there once Ray has restarted it)."""
        exclude = frozenset({left}) if left is not None else frozenset()
        job = self.now(req, exclude)
        if job is not None:
            return job
        waiter = Waiter(req, exclude if migrated else frozenset())
        self.moving.append(waiter)
        return await self.wait(waiter)

    async def wait(self, waiter: Waiter) -> Job:
        """The job once the waiter is placed; leaving (cancelled) takes it out of line."""
        try:
            return await waiter.future
        finally:
            if not waiter.future.done() or waiter.future.cancelled():
                self.queue.remove(waiter)
                with contextlib.suppress(ValueError):
                    self.moving.remove(waiter)
            elif asyncio.current_task() is not None and asyncio.current_task().cancelling():
                # placed, but its caller left before taking the job: the view must not keep counting it
                job = waiter.future.result()
                self.view.forget(job.key)

    def _job(self, req: ClusterRequest, target: str, exclude: frozenset[str]) -> Job:
        names = req.composition.names if req.composition is not None else ()
        job = req.job(self.view.origin, target, exclude, self._sources(names))
        self.view.note_sent(target, job.key, job.route)
        return job

    # ---- the waiting requests -----------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), DISPATCH_S if (self.queue or self.moving) else 0.5)
            self._wake.clear()
            try:
                self.dispatch()
            except Exception:   # a bug here must not stop every later request
                log.exception("placing waiting requests")
            self._on_queue(len(self.queue), len(self.moving))

    def dispatch(self) -> None:
        """Place waiting requests that have room now: moving ones first, then the queue in order."""
        for waiter in list(self.moving):
            if waiter.future.done():
                self.moving.remove(waiter)
                continue
            job = self.now(waiter.request, waiter.exclude)
            if job is not None:
                self.moving.remove(waiter)
                waiter.future.set_result(job)
        if not self.queue:
            return
        placed: list = []

        def choose(waiter: Waiter) -> str | None:
            route = waiter.request.route()
            target = None if waiter.future.done() else self.view.choose(route, waiter.exclude, assume=placed)
            if target is not None:
                placed.append((target, route))
            return target

        for waiter, target in self.queue.pop_ready(choose):
            waiter.future.set_result(self._job(waiter.request, target, waiter.exclude))
