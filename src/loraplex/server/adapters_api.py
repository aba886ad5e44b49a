"""`/v1/adapters`: register, list and remove adapters while the server serves.

Loads read only inside the operator's `--adapter-root` folders: the path and every file in its
folder are resolved (symlinks and `..` followed) and must land inside them, else 403. (The check
is made at registration; the operator is trusted not to swap files inside the roots later, when
an evicted adapter is read again.) The folder is validated in full before
it is registered — config, every key and shape, and every weight read and checked finite — so a
bad adapter is reported to the caller who sent it and nothing else changes. Only safetensors, or
`.bin` through `torch.load(weights_only=True)`, is ever read (the adapters package's rule).

Removal never cuts a request short: the name stops being served at once (new requests get 404),
and the adapter leaves the engine when the last request using it ends.
"""
from __future__ import annotations

import time
from pathlib import Path

import anyio
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from ..adapters import AdapterError, inspect_peft_adapter, read_peft_adapter
from ..adapters.spec import check_adapter_name
from .errors import APIError
from .state import AdapterRecord, ServerState

router = APIRouter()


class AdapterLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    path: str


def _state(request: Request) -> ServerState:
    return request.app.state.loraplex   # the admin key was checked by guards.Guard


def _inside(path: Path, roots: list[Path]) -> bool:
    return any(path == root or path.is_relative_to(root) for root in roots)


def resolve_inside_roots(path: str, roots: list[Path]) -> Path:
    """The folder `path` names (absolute, or relative to a root: the first root that has it), if it
    and every file in it resolve inside the roots; 403 if anything points outside them."""
    if not roots:
        raise APIError(403, "loading adapters at run time is off: start the server with --adapter-root DIR "
                            "(repeatable) to allow loads from inside DIR", code="adapter_loading_disabled")
    if not path or "\x00" in path:
        raise APIError(400, "the adapter path is empty or invalid", param="path")
    given = Path(path)
    candidates = [given] if given.is_absolute() else [root / given for root in roots]
    allowed = False
    for candidate in candidates:
        try:
            resolved = candidate.resolve()   # follows symlinks and `..`: what would really be read
        except (OSError, RuntimeError):       # a symlink loop, an unreadable path
            continue
        if not _inside(resolved, roots):
            continue
        allowed = True
        if resolved.is_dir():
            _check_files_inside(resolved, roots, path)
            return resolved
    if not allowed:
        raise APIError(403, f"the adapter path {path!r} is outside the server's adapter roots", param="path",
                       code="path_not_allowed")
    raise APIError(400, f"no adapter folder at {path!r} inside the adapter roots", param="path",
                   code="adapter_not_found")


def _check_files_inside(folder: Path, roots: list[Path], shown: str) -> None:
    """A folder inside the roots may still hold symlinks to files elsewhere: refuse those too."""
    try:
        entries = list(folder.iterdir())
    except OSError as e:
        raise APIError(400, f"cannot list the adapter folder {shown!r}: {e.strerror}", param="path") from None
    for entry in entries:
        try:
            target = entry.resolve()
        except (OSError, RuntimeError):
            target = None
        if target is None or not _inside(target, roots):
            raise APIError(403, f"{shown}/{entry.name} points outside the server's adapter roots", param="path",
                           code="path_not_allowed")


def _validate_and_register(state: ServerState, name: str, folder: Path) -> None:
    """Runs on a worker thread (reads can take seconds): the folder against the served model,
    every weight read and checked, then registered."""
    cache = state.cache
    spec = inspect_peft_adapter(folder, cache.model, name=name, max_rank=cache.pool.max_rank)
    read_peft_adapter(spec, cache.pool.dtype, pin=False)
    cache.register(name, folder)


@router.get("/v1/adapters")
async def list_adapters(request: Request) -> dict:
    state = _state(request)
    data = []
    for name, record in sorted(state.adapters.items()):
        if name in state.draining or name not in state.cache:
            continue
        spec = state.cache.spec(name)
        data.append({"id": name, "object": "adapter", "created": record.created, "parent": state.model_name,
                     "tier": state.cache.state(name).value, "rank": spec.max_rank, "targets": spec.projections,
                     "source": record.source, "requests_served": record.requests_served,
                     "requests_running": state.in_flight_by_adapter.get(name, 0)})
    return {"object": "list", "data": data}


@router.post("/v1/adapters")
async def load_adapter(request: Request, body: AdapterLoad) -> dict:
    state = _state(request)
    try:
        check_adapter_name(body.name)
    except AdapterError as e:
        raise APIError(400, str(e), param="name") from None
    if body.name == state.model_name or body.name in state.adapters or body.name in state.cache:
        what = "is being removed (requests still use it)" if body.name in state.draining else "is already served"
        raise APIError(409, f"the name {body.name!r} {what}", param="name", code="adapter_exists")
    folder = resolve_inside_roots(body.path, state.settings.adapter_roots)
    start = time.monotonic()
    try:
        await anyio.to_thread.run_sync(_validate_and_register, state, body.name, folder)
    except AdapterError as e:
        if body.name in state.cache or "still being unregistered" in str(e):   # a name clash, not a bad folder
            raise APIError(409, f"the name {body.name!r}: {e}", param="name", code="adapter_exists") from None
        raise APIError(400, f"adapter {body.name!r} did not load: {e}", param="path", code="invalid_adapter") from None
    state.metrics.adapter_loaded(time.monotonic() - start, "register")
    state.adapters[body.name] = AdapterRecord(body.name, str(folder), int(time.time()))
    state.cache.prefetch(body.name)   # warm it up before its first request
    spec = state.cache.spec(body.name)
    return {"id": body.name, "object": "adapter", "parent": state.model_name, "rank": spec.max_rank,
            "targets": spec.projections, "source": str(folder)}


@router.delete("/v1/adapters/{name:path}")   # names may hold "/"
async def remove_adapter(request: Request, name: str) -> dict:
    state = _state(request)
    if name not in state.adapters or name in state.draining:
        raise APIError(404, f"no adapter named {name!r}", param="name", code="adapter_not_found")
    del state.adapters[name]
    if state.in_flight_by_adapter.get(name, 0) > 0:
        state.draining.add(name)   # unregistered by the last of its requests (ServerState.ended)
    else:
        state.finish_removal(name)
    return {"id": name, "object": "adapter", "deleted": True}
