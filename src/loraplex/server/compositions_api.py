"""Named compositions on the server: a name for {adapter: weight} (a recipe: the kernels combine the
members per request, no weights are copied), registered in the server's table and the engine's.
The routes are adapters_api.py's (`POST /v1/adapters {"name", "compose"}`, `DELETE
/v1/adapters/{name}`); `/v1/models` lists them with their members in `compose`.

- A composition is visible to, and usable by, a key that may use its name and every member
  (targets.py: `may_use_composition`).
- An adapter that a composition uses cannot be removed (409 naming the compositions): remove those
  first. Removing a composition does not cut short the requests running with it.
- Entered in the server's table before the engine is asked (`registering` until it answers), so a
  concurrent delete of a member sees it; a delete of the composition meanwhile gets 409.
"""
from __future__ import annotations

import logging
import time
from typing import Any

import anyio

from ..adapters import AdapterError
from ..adapters.composition import Composition
from ..engine.async_engine import EngineDeadError
from .errors import APIError, public_text
from .generation import adapter_unavailable
from .composition_fields import parse_composition
from .state import CompositionRecord, ServerState
from .targets import check_members, may_use_composition
from .tenants import Access

log = logging.getLogger("loraplex.server")


def visible_compositions(state: ServerState, access: Access) -> list[CompositionRecord]:
    """The named compositions served now that `access` may use, by name."""
    return [record for name, record in sorted(state.compositions.items())
            if not record.registering and may_use_composition(access, name, record.composition)]


def composition_models(state: ServerState, access: Access) -> list[dict]:
    """`/v1/models`' entries for the named compositions `access` may use: `compose` holds their members
    and weights."""
    return [{"id": record.name, "object": "model", "created": record.created, "owned_by": "loraplex",
             "root": record.name, "parent": state.model_name, "max_model_len": state.max_model_len,
             "compose": dict(record.composition.members)} for record in visible_compositions(state, access)]


def composition_entry(state: ServerState, record: CompositionRecord) -> dict:
    """Its entry in `GET /v1/adapters`."""
    return {"id": record.name, "object": "composition", "created": record.created, "parent": state.model_name,
            "compose": dict(record.composition.members)}


async def register_composition(state: ServerState, access: Access, name: str, compose: Any) -> Composition:
    """Register `compose` ({adapter: weight}) as the named composition `name` (a name the caller has
    checked is free and this key's), in the engine too; the composition."""
    composition = parse_composition(compose, "compose")
    if composition is None:
        raise APIError(400, "compose must name at least one adapter with a non-zero weight", param="compose")
    check_members(state, composition, access, "compose")
    # in the server's table before the await: a concurrent delete of a member sees it (409)
    record = state.compositions[name] = CompositionRecord(name, composition, int(time.time()))
    try:
        await anyio.to_thread.run_sync(state.engine.add_composition, name, composition)
    except BaseException as e:
        if name in state.engine.compositions():   # its caller was cancelled once the engine had it
            record.registering = False
        else:
            del state.compositions[name]
        raise _engine_refusal(state, composition, e) from None
    record.registering = False
    return composition


def _engine_refusal(state: ServerState, composition: Composition, e: BaseException) -> BaseException:
    """The engine's refusal of a composition as the client should see it (the checks above make it rare)."""
    if isinstance(e, EngineDeadError):
        return APIError(503, "the engine is not running", code="engine_dead")
    if not isinstance(e, ValueError):   # AdapterError is one
        return e
    message = str(e)
    if "already registered" in message:
        return APIError(409, public_text(message), param="name", code="adapter_exists")
    failed = next((m for m in composition.names if f"adapter {m!r} failed to load" in message), None)
    if failed is not None:
        return adapter_unavailable(state, failed, message, "compose")
    return APIError(400, public_text(message), param="compose")


async def remove_composition(state: ServerState, record: CompositionRecord) -> None:
    """Stop serving it (new requests get 404; running ones go on with it), and drop it from the engine."""
    if record.registering:
        raise APIError(409, f"the composition {record.name!r} is still being registered; try again",
                       param="name", code="adapter_exists")
    del state.compositions[record.name]   # new requests get 404 now; running ones go on with it
    try:
        await anyio.to_thread.run_sync(state.engine.remove_composition, record.name)
    except EngineDeadError:
        raise APIError(503, "the engine is not running", code="engine_dead") from None
    except AdapterError as e:   # not in the engine: nothing to undo
        log.warning("removing composition %r: %s", record.name, e)


def check_unused(state: ServerState, access: Access, adapter: str) -> None:
    """409 naming the compositions that `adapter` is a member of (those this key may see; the others
    counted): deleting a member is refused, never cascaded."""
    users = sorted(c for c, r in state.compositions.items() if adapter in r.composition.names)
    if users:
        named = [repr(c) for c in users if may_use_composition(access, c, state.compositions[c].composition)]
        if len(named) < len(users):   # a tenant hears how many others, not their names
            named.append(f"{len(users) - len(named)} you cannot see")
        raise APIError(409, f"the adapter {adapter!r} is a member of the composition(s) {', '.join(named)}: "
                            f"remove them first", param="name", code="adapter_in_use")
