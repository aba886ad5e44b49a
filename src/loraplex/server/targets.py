"""What a completion or chat request runs on (`resolve` → `Target`): the base model, an adapter, or
a composition of adapters with weights.

- `model` names the base model, an adapter, or a named composition (POST /v1/adapters
  {"name", "compose"}: adapters_api.py).
- `adapters` ({adapter: weight}, protocol.py parses it) composes adapters on the base model;
  `model` must then name the base model (400 otherwise: one request, one answer to "which
  weights"). `{}`, or every weight 0, is the base model; one adapter at weight 1 is that adapter.
- Every adapter must be one served now that the caller may use, else 404, the same answer as for a
  made-up name (a tenant cannot tell others' adapters exist); a named composition is open to a key
  that may use its name and every member. A key without the base model may still compose the
  adapters it may use.
- A composition takes at most min(max_adapters_per_request, max_gpu_adapters) adapters (400).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..adapters.composition import Composition
from .errors import APIError
from .metrics import COMPOSED_LABEL
from .state import ServerState
from .tenants import Access


@dataclass(frozen=True)
class Target:
    """What a request runs on."""
    adapter: str | Composition | None   # what the engine is given: an adapter's name, a composition, or None
    label: str | None                   # for the metrics: the adapter, the named composition, COMPOSED_LABEL
    members: tuple[str, ...] = ()       # the adapters it runs with (counted in flight; metrics by member)
    param: str = "model"                # the request field that named them


BASE = Target(None, None)


def _not_found(model: str) -> APIError:
    return APIError(404, f"the model {model!r} does not exist: GET /v1/models lists the models you may use",
                    param="model", code="model_not_found")


def resolve_model(state: ServerState, model: str, access: Access) -> Target:
    """What `model` names: the base model, an adapter, or a named composition; 404 if it names nothing
    served, or nothing the caller may use (the same answer: a tenant cannot tell others' adapters exist)."""
    if model == state.model_name:
        if access.base_model:
            return BASE
        raise _not_found(model)
    if model in state.adapters and model not in state.draining and access.may_use(model):
        return Target(model, model, (model,))
    record = state.compositions.get(model)
    if record is not None and may_use_composition(access, model, record.composition):
        composition = record.composition
        return Target(composition.single or composition, model, composition.names)
    raise _not_found(model)


def may_use_composition(access: Access, name: str, composition: Composition) -> bool:
    """A named composition is open to a key that may use its name and every member."""
    return access.may_use(name) and all(access.may_use(member) for member in composition.names)


def check_members(state: ServerState, composition: Composition, access: Access, param: str) -> None:
    """Every member is an adapter served now that the caller may use (else 404; a named composition:
    400), and the engine can hold them all at once (else 400); errors name `param`."""
    for name in composition.names:
        if name in state.compositions and may_use_composition(access, name, state.compositions[name].composition):
            raise APIError(400, f"{name!r} in {param} is a composition: {param} combines adapters, not "
                                f"compositions", param=param)
        if name not in state.adapters or name in state.draining or not access.may_use(name):
            raise APIError(404, f"the adapter {name!r} in {param} does not exist: GET /v1/models lists the "
                                f"models you may use", param=param, code="model_not_found")
    config = state.core.config
    if composition.single is None and config.max_adapters_per_request == 1:
        raise APIError(400, f"{param}: this server serves one adapter per request, at weight 1", param=param)
    limit = min(config.max_adapters_per_request, config.max_gpu_adapters)
    if len(composition.names) > limit:
        raise APIError(400, f"{param} combines {len(composition.names)} adapters; this server takes at most "
                            f"{limit} in one request", param=param)


def resolve(state: ServerState, req, access: Access) -> Target:
    """What a completion or chat request runs on (the module docstring says how `model` and
    `adapters` combine)."""
    if req.adapters is None:
        return resolve_model(state, req.model, access)
    if req.model != state.model_name:
        resolve_model(state, req.model, access)   # 404 if it names nothing
        raise APIError(400, f"adapters composes adapters on the base model: send it with model "
                            f"{state.model_name!r}, or name {req.model!r} in model alone", param="adapters")
    composition = req.composition
    if composition is None:   # {} or every weight 0: the base model
        return resolve_model(state, req.model, access)
    check_members(state, composition, access, "adapters")
    if composition.single is not None:   # {"sql": 1}: the adapter alone
        return Target(composition.single, composition.single, composition.names, "adapters")
    return Target(composition, COMPOSED_LABEL, composition.names, "adapters")


def requested_label(state: ServerState, req) -> str | None:
    """The metrics label of a request refused before it ran (as it asked, before any check)."""
    if req.adapters:
        return COMPOSED_LABEL
    return None if req.model == state.model_name else req.model
