"""What every request passes before a route runs, in this order: the API keys (401, 403), then the
body-size limit (413). Both act before the body is parsed, so an unauthenticated client learns
nothing about what a valid request looks like. Last, a body that names one adapter twice in its
`adapters` or `compose` object gets 400 (`COMPOSING_PATHS`; only the raw body shows it: JSON
parsers keep the last of duplicated keys).

Routes by the key they need (`Authenticator`):
- open: `/health`, `/version`, `/docs`, `/openapi.json`; `/metrics` too unless
  `--metrics-require-key` (then: the admin key, `--api-key`, or a tenant with `metrics`);
- management (`/v1/adapters…`, `/v1/load_lora_adapter`, `/v1/unload_lora_adapter`): the admin key
  (`--admin-api-key`, else `--api-key`), or a tenant key with `manage_adapters`;
- everything else: `--api-key`, the admin key, or a tenant key (`--api-keys FILE`, tenants.py).
A route is open where none of the keys it could take is set. The caller's `Access` (what it may
use) rides in the ASGI scope under `ACCESS_SCOPE_KEY` (read it with `access_of(request)`).
"""
from __future__ import annotations

import hmac

from .errors import APIError, error_response
from .composition_fields import duplicated_member
from .tenants import FULL, USE_ALL, Access, KeyRing

OPEN_PATHS = ("/health", "/version", "/docs", "/docs/oauth2-redirect", "/openapi.json")
METRICS_PATH = "/metrics"
ADMIN_PREFIX = "/v1/adapters"
ADMIN_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
ACCESS_SCOPE_KEY = "loraplex.access"
COMPOSING_PATHS = ("/v1/completions", "/v1/chat/completions", ADMIN_PREFIX)   # bodies that may compose adapters


def route_kind(path: str) -> str:
    """"open", "metrics", "manage" or "use": which keys a path takes."""
    if path in OPEN_PATHS:
        return "open"
    if path == METRICS_PATH:
        return "metrics"
    if path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/") or path in ADMIN_PATHS:
        return "manage"
    return "use"


def access_of(request) -> Access:
    return request.scope.get(ACCESS_SCOPE_KEY, FULL)


class Authenticator:
    """Who a bearer key is, for one kind of route (module docstring); APIError 401/403 if refused."""

    def __init__(self, api_key: str | None, admin_key: str | None, keyring: KeyRing | None = None,
                 metrics_require_key: bool = False) -> None:
        self.api_key, self.admin_key, self.keyring = api_key, admin_key, keyring
        self.metrics_require_key = metrics_require_key

    def access(self, authorization: str | None, kind: str) -> Access:
        if self._is_open(kind):
            return FULL
        what = "admin" if kind == "manage" and self.keyring is None else "API"
        token = _bearer(authorization)
        if token is None:
            raise APIError(401, f"missing {what} key: send 'Authorization: Bearer <key>'", code="missing_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        access = self._identify(token)
        if access is None:
            raise APIError(401, f"invalid {what} key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        if kind == "manage" and not access.manage:
            raise APIError(403, "this key may not manage adapters", code="permission_denied")
        if kind == "metrics" and not access.metrics:
            raise APIError(403, "this key may not read the metrics", code="permission_denied")
        return access

    def _is_open(self, kind: str) -> bool:
        if kind == "open":
            return True
        if kind == "metrics":
            return not self.metrics_require_key or (self.keyring is None and self.admin_key is None)
        if self.keyring is not None:
            return False
        return (self.admin_key if kind == "manage" else self.api_key) is None

    def _identify(self, token: str) -> Access | None:
        if _matches(token, self.admin_key):
            return FULL
        if _matches(token, self.api_key):
            return USE_ALL
        return self.keyring.lookup(token) if self.keyring is not None else None


def _matches(token: str, expected: str | None) -> bool:
    # constant time: no guessing a key by timing
    return expected is not None and hmac.compare_digest(token.encode("utf-8", "surrogateescape"),
                                                        expected.encode("utf-8", "surrogateescape"))


class Guard:
    """ASGI middleware: keys (`Authenticator`), then a body over `limit` bytes gets 413, whether it
    announces its length or not (so a huge body costs at most `limit` bytes of memory)."""

    def __init__(self, app, limit: int, auth: Authenticator) -> None:
        self.app, self.limit, self.auth = app, limit, auth

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            scope[ACCESS_SCOPE_KEY] = self.auth.access(_header(scope, b"authorization"),
                                                       route_kind(scope.get("path", "")))
        except APIError as e:
            await e.response()(scope, receive, send)
            return
        message = f"the request body is larger than this server's limit of {self.limit} bytes"
        for key, value in scope.get("headers", ()):
            if key == b"content-length":
                try:
                    too_large = int(value) > self.limit
                except ValueError:
                    too_large = False
                if too_large:
                    await error_response(413, message, code="request_too_large")(scope, receive, send)
                    return
        # read the whole body first (it is at most `limit` bytes), then hand it on: a parser that
        # catches errors while reading could not tell "too large" from "malformed"
        messages, received = [], 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                messages.append(msg)
                break
            received += len(msg.get("body", b""))
            if received > self.limit:
                await error_response(413, message, code="request_too_large")(scope, receive, send)
                return
            messages.append(msg)
            if not msg.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if scope.get("method") == "POST" and scope.get("path") in COMPOSING_PATHS:
            duplicate = duplicated_member(body)
            if duplicate is not None:
                field, name = duplicate
                await error_response(400, f"{field}: the adapter {name!r} is given twice", param=field)(
                    scope, receive, send)
                return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                if messages and messages[-1]["type"] != "http.request":
                    return messages[-1]   # the client left while sending
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()   # after the body: disconnect notices

        await self.app(scope, replay, send)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return value.decode("latin-1")
    return None


def _bearer(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None
