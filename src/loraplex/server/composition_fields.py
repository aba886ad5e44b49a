"""The `{adapter: weight}` objects of request bodies: a request's `adapters` and `POST /v1/adapters`' `compose`.

`parse_composition` turns one into a Composition (adapters/composition.py) or a 400 naming the member at fault;
`duplicated_member` finds an adapter named twice in a raw body (JSON parsers keep the last of duplicated keys, so
guards.py refuses such bodies before they are parsed).
"""
from __future__ import annotations

import json
from typing import Any

from loraplex.adapters.composition import MAX_MEMBERS, Composition

from .errors import APIError


def _refuse(param: str, message: str) -> APIError:
    return APIError(400, message, param=param)


COMPOSITION_FIELDS = ("adapters", "compose")   # the request field, and POST /v1/adapters' field


def parse_composition(value: Any, param: str) -> Composition | None:
    """`value`, an object of adapter names to weights, as a Composition (None when it names no adapter
    with a non-zero weight); APIError(400, param=`param`) naming the member at fault: more than
    MAX_MEMBERS adapters, a weight that is not a finite JSON number (`true`, "0.5", NaN, Infinity,
    an integer too large for a float), an empty name."""
    if not isinstance(value, dict):
        raise _refuse(param, f"{param} must be an object of adapter names to weights, got {type(value).__name__}")
    if len(value) > MAX_MEMBERS:   # before looking at each member: the object may be large
        raise _refuse(param, f"{param} combines {len(value)} adapters; at most {MAX_MEMBERS}")
    for name, weight in value.items():
        if isinstance(weight, int) and not isinstance(weight, bool):
            try:
                float(weight)
            except OverflowError:
                raise _refuse(param, f"{param}[{name!r}]: the weight is too large for a float") from None
    try:
        return Composition.parse(value, param)
    except ValueError as e:
        raise _refuse(param, str(e)) from None


class _Object(dict):
    """A JSON object that remembers the first key it was given twice (json keeps the last value)."""

    duplicate: str | None = None


def _object_hook(pairs: list[tuple[str, Any]]) -> _Object:
    obj = _Object(pairs)
    if len(obj) < len(pairs):
        seen: set[str] = set()
        obj.duplicate = next(key for key, _ in pairs if key in seen or seen.add(key))
    return obj


def duplicated_member(body: bytes) -> tuple[str, str] | None:
    """(field, name) if the body's top-level `adapters` or `compose` object names an adapter twice;
    None otherwise, or if the body is not JSON (its route's parser reports that). Parsers keep the
    last of duplicated keys, so this must read the raw body."""
    # A key spells its name literally (UTF-8), with \u escapes, or in UTF-16/32 (NUL bytes):
    # a body with none of these cannot name the fields, and is not parsed twice.
    if not any(field.encode() in body for field in COMPOSITION_FIELDS) and b"\\u" not in body \
            and b"\x00" not in body:
        return None
    try:
        data = json.loads(body, object_pairs_hook=_object_hook)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    for field in COMPOSITION_FIELDS:
        value = data.get(field)
        if isinstance(value, _Object) and value.duplicate is not None:
            return field, value.duplicate
    return None
