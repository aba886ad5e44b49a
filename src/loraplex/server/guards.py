"""What every request passes before a route runs, in this order: the API keys (401), then the
body-size limit (413). Both act before the body is parsed, so an unauthenticated client learns
nothing about what a valid request looks like."""
from __future__ import annotations

import hmac

from .errors import APIError, error_response


OPEN_PATHS = ("/health",)
ADMIN_PREFIX = "/v1/adapters"


class Guard:
    """ASGI middleware: keys, then a body over `limit` bytes gets 413, whether it announces its
    length or not (so a huge body costs at most `limit` bytes of memory).

    Keys: `/health` is open; `/v1/adapters…` needs `admin_key`; everything else `api_key`.
    """

    def __init__(self, app, limit: int, api_key: str | None, admin_key: str | None) -> None:
        self.app, self.limit = app, limit
        self.api_key, self.admin_key = api_key, admin_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        if path not in OPEN_PATHS:
            admin = path == ADMIN_PREFIX or path.startswith(ADMIN_PREFIX + "/")
            try:
                check_key(_header(scope, b"authorization"), self.admin_key if admin else self.api_key,
                          "admin" if admin else "API")
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


def check_key(authorization: str | None, expected: str | None, what: str = "API") -> None:
    """401 unless the `Authorization` header is `Bearer <expected>` (no key set: open)."""
    if expected is None:
        return
    given = _bearer(authorization)
    if given is None:
        raise APIError(401, f"missing {what} key: send 'Authorization: Bearer <key>'", code="missing_api_key",
                       headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.encode(), expected.encode()):   # constant time: no guessing by timing
        raise APIError(401, f"invalid {what} key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
