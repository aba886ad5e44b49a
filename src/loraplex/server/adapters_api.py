"""`/v1/adapters`: register, list and remove adapters while the server serves; and vLLM's
`POST /v1/load_lora_adapter {"lora_name", "lora_path"}` and `POST /v1/unload_lora_adapter
{"lora_name"}`, the same operations (same key, same confinement) answered as vLLM does, in text.

Named compositions: `POST /v1/adapters {"name", "compose": {adapter: weight}}` registers a recipe
(no weights copied: the kernels combine the members per request) that clients then use as
`model`; it is listed by `/v1/models` and `GET /v1/adapters` with its `compose`, and
`DELETE /v1/adapters/{name}` (or vLLM's unload) removes it. Requests already running with it go
on. Removing an adapter that a composition uses is refused (409, naming the compositions): remove
those first. Adapters and compositions share one namespace.

A tenant key with `manage_adapters` (tenants.py) manages only the names its `adapters` patterns
allow: it lists only those, and the others are, to it, adapters that do not exist.

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
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from ..adapters import AdapterError, inspect_peft_adapter, read_peft_adapter
from ..adapters.spec import check_adapter_name
from .compositions_api import (
    check_unused,
    composition_entry,
    register_composition,
    remove_composition,
    visible_compositions,
)
from .errors import APIError, public_text
from .guards import access_of
from .state import AdapterRecord, ServerState
from .targets import may_use_composition
from .tenants import Access

router = APIRouter()


class AdapterLoad(BaseModel):   # an adapter folder (`path`), or a named composition (`compose`)
    model_config = ConfigDict(extra="forbid")
    name: str
    path: str | None = None
    compose: dict[str, Any] | None = None


class LoraAdapterLoad(BaseModel):   # vLLM's body (its other fields, e.g. lora_int_id, are ignored)
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class LoraAdapterUnload(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


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
    try:   # a lone surrogate ("\ud800") cannot name a file: Path.resolve() would raise
        path.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, "the adapter path is not valid text (it holds a lone surrogate)", param="path") from None
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
        raise APIError(400, f"cannot list the adapter folder {shown!r}: {public_text(e.strerror or '')}",
                       param="path") from None
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
    spec = inspect_peft_adapter(folder, cache.model, name=name)
    cache.pool.check_fits(spec.max_rank, name)   # names --max-lora-rank
    read_peft_adapter(spec, cache.pool.dtype, pin=False)
    cache.register(name, folder)


@router.get("/v1/adapters")
async def list_adapters(request: Request) -> dict:
    state, access = _state(request), access_of(request)
    data = []
    for name, record in sorted(state.adapters.items()):
        if name in state.draining or name not in state.cache or not access.may_use(name):
            continue
        spec = state.cache.spec(name)
        data.append({"id": name, "object": "adapter", "created": record.created, "parent": state.model_name,
                     "tier": state.cache.tier(name),
                     "resident": state.cache.is_resident(name),   # in a slot: usable by the next step
                     "rank": spec.max_rank, "targets": spec.projections,
                     "source": shown_source(state, access, record.source),
                     "requests_served": record.requests_served,
                     "requests_running": state.in_flight_by_adapter.get(name, 0)})
    data += [composition_entry(state, record) for record in visible_compositions(state, access)]
    return {"object": "list", "data": data}


def shown_source(state: ServerState, access: Access, source: str) -> str:
    """Where an adapter came from, as this caller may see it: the server's path for the operator's
    keys; for a tenant's, relative to the adapter root holding it (or just its name)."""
    if access.tenant is None:
        return source
    path = Path(source)
    for root in state.settings.adapter_roots:
        if path.is_relative_to(root):
            return str(path.relative_to(root))
    return path.name


def _check_new_name(state: ServerState, access: Access, name: str) -> None:
    """A name this key may give to a new adapter or composition: allowed (400), its own (403), free (409)."""
    try:
        check_adapter_name(name)
    except AdapterError as e:
        raise APIError(400, public_text(str(e)), param="name") from None
    if not access.may_use(name):
        raise APIError(403, f"this key may not manage adapters named {name!r}", param="name",
                       code="permission_denied")
    if name == state.model_name or name in state.adapters or name in state.cache or name in state.compositions:
        what = "is being removed (requests still use it)" if name in state.draining else "is already served"
        raise APIError(409, f"the name {name!r} {what}", param="name", code="adapter_exists")


async def register(state: ServerState, access: Access, name: str, path: str) -> Path:
    """Validate and register the adapter folder `path` (inside the roots) as `name`; the folder."""
    _check_new_name(state, access, name)
    folder = resolve_inside_roots(path, state.settings.adapter_roots)
    start = time.monotonic()
    try:
        await anyio.to_thread.run_sync(_validate_and_register, state, name, folder)
    except AdapterError as e:
        if name in state.cache or "still being unregistered" in str(e):   # a name clash, not a bad folder
            raise APIError(409, f"the name {name!r}: {public_text(str(e))}", param="name",
                           code="adapter_exists") from None
        raise APIError(400, f"adapter {name!r} did not load: {public_text(str(e))}", param="path",
                       code="invalid_adapter") from None
    state.metrics.adapter_loaded(time.monotonic() - start, "register")
    state.adapters[name] = AdapterRecord(name, str(folder), int(time.time()))
    state.cache.prefetch(name)   # warm it up before its first request
    return folder


async def unregister(state: ServerState, access: Access, name: str) -> str:
    """Stop serving `name`, an adapter (it leaves the engine once its last request has ended) or a named
    composition; what it was ("adapter" or "composition")."""
    record = state.compositions.get(name)
    if record is not None and may_use_composition(access, name, record.composition):
        await remove_composition(state, record)
        return "composition"
    if name not in state.adapters or name in state.draining or not access.may_use(name):
        raise APIError(404, f"no adapter named {name!r}", param="name", code="adapter_not_found")
    check_unused(state, access, name)
    del state.adapters[name]
    if state.in_flight_by_adapter.get(name, 0) > 0:
        state.draining.add(name)   # unregistered by the last of its requests (ServerState.release)
    else:
        state.finish_removal(name)
    return "adapter"


@router.post("/v1/adapters")
async def load_adapter(request: Request, body: AdapterLoad) -> dict:
    state, access = _state(request), access_of(request)
    if body.compose is not None:
        if body.path is not None:
            raise APIError(400, "send path (an adapter folder) or compose (a composition of adapters), not both",
                           param="compose")
        _check_new_name(state, access, body.name)
        composition = await register_composition(state, access, body.name, body.compose)
        return {"id": body.name, "object": "composition", "parent": state.model_name,
                "compose": dict(composition.members)}
    if body.path is None:
        raise APIError(400, "path (an adapter folder) or compose (a composition of adapters) is required",
                       param="path")
    folder = await register(state, access, body.name, body.path)
    spec = state.cache.spec(body.name)
    return {"id": body.name, "object": "adapter", "parent": state.model_name, "rank": spec.max_rank,
            "targets": spec.projections, "source": shown_source(state, access, str(folder))}


@router.delete("/v1/adapters/{name:path}")   # names may hold "/"
async def remove_adapter(request: Request, name: str) -> dict:
    kind = await unregister(_state(request), access_of(request), name)
    return {"id": name, "object": kind, "deleted": True}


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: Request, body: LoraAdapterLoad) -> PlainTextResponse:
    try:
        await register(_state(request), access_of(request), body.lora_name, body.lora_path)
    except APIError as e:
        raise _vllm_params(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: Request, body: LoraAdapterUnload) -> PlainTextResponse:
    try:
        await unregister(_state(request), access_of(request), body.lora_name)
    except APIError as e:
        raise _vllm_params(e) from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _vllm_params(e: APIError) -> APIError:
    """The error with the vLLM body's field names."""
    e.param = {"name": "lora_name", "path": "lora_path"}.get(e.param, e.param)
    return e
