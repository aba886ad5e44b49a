"""OpenAI-style errors: `APIError`, the JSON body every error response carries, and the handlers
that give every error the app can produce that body.

Every error response is::

    {"error": {"message": str, "type": str, "param": str | None, "code": str | None}}

with the message cut to `MAX_MESSAGE_CHARS`, so a huge request value is never echoed back in full,
and cleaned (`clean_text`): no terminal escape codes or control characters, no lone surrogates.
Text from elsewhere (an exception's message) goes through `public_text` first, which also cuts the
server's absolute paths to their last part: errors name the field and the adapter, not the
server's filesystem.
`install_error_handlers(app)` covers `APIError`, FastAPI's request validation errors (400, naming
the fields at fault but never their values), Starlette's `HTTPException` (unknown route 404, wrong
method 405, ...) and any other exception (500 "internal server error", logged, no traceback).
"""
from __future__ import annotations

import http
import logging
import re
from collections.abc import Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("loraplex.server")

MAX_MESSAGE_CHARS = 500
MAX_PARAM_CHARS = 200
MAX_VALIDATION_PROBLEMS = 3  # listed in one 400 message; the rest are counted
_MAX_LOC_PART_CHARS = 40  # a dict key in a location is the client's text: keep it short

_TYPES_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "invalid_request_error",
    424: "invalid_request_error",   # the request's adapter could not be loaded (its files)
    429: "rate_limit_error",
    503: "service_unavailable",
}


def default_error_type(status: int) -> str:
    """OpenAI's `error.type` for a status: the table above, else by class (4xx / 5xx)."""
    if status in _TYPES_BY_STATUS:
        return _TYPES_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


_ESCAPES = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-_]|\x9b[0-?]*[ -/]*[@-~]")   # ANSI (colours, cursor)
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# an absolute path of at least two parts (/a/b, C:\\a\\b): kept is its last part
_PART = r"[^\s'\"/\\:,;()<>\[\]{}|`]"
_ABSOLUTE_PATH = re.compile(rf"(?<![\w.~/\\-])(?:[A-Za-z]:)?[/\\](?:{_PART}+[/\\])+({_PART}*)")


def clean_text(text: str) -> str:
    """`text` without terminal escape codes and control characters (newlines and tabs stay), and
    with lone surrogates (which UTF-8 cannot carry) written as escapes."""
    text = _CONTROLS.sub("", _ESCAPES.sub("", str(text)))
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def public_text(text: str) -> str:
    """An exception's message fit for a client: `clean_text`, and absolute paths cut to their last
    part ('/srv/adapters/a/adapter_model.safetensors' → 'adapter_model.safetensors')."""
    return _ABSOLUTE_PATH.sub(lambda m: m.group(1) or "<path>", clean_text(text))


def _shorten(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def error_body(status: int, message: str, *, type: str | None = None, param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object for `status`; `type` defaults by status."""
    return {"error": {
        "message": _shorten(clean_text(message), MAX_MESSAGE_CHARS),
        "type": type if type is not None else default_error_type(status),
        "param": None if param is None else _shorten(clean_text(param), MAX_PARAM_CHARS),
        "code": code,
    }}


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, type=type, param=param, code=code),
                        status_code=status, headers=headers)


class APIError(Exception):
    """An error the client should see as it is: status, message, and OpenAI's type/param/code.

    `headers` ride along on the response (e.g. `Retry-After` on 429, `WWW-Authenticate` on 401).
    """

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        if isinstance(status, bool) or not isinstance(status, int) or not 400 <= status <= 599:
            raise ValueError(f"APIError.status must be an HTTP error status in [400, 599], got {status!r}")
        super().__init__(message)
        self.status = status
        self.message = str(message)
        self.type = type if type is not None else default_error_type(status)
        self.param = param
        self.code = code
        self.headers = dict(headers) if headers else None

    def body(self) -> dict:
        return error_body(self.status, self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, type=self.type, param=self.param,
                              code=self.code, headers=self.headers)

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


# ---- request validation (pydantic) errors -----------------------------------------------------

def _loc_path(loc: Sequence) -> str:
    """("body", "messages", 0, "role") -> "body.messages[0].role"."""
    path = ""
    for part in loc:
        if isinstance(part, int) and not isinstance(part, bool):
            path += f"[{part}]"
        else:
            part = _shorten(str(part), _MAX_LOC_PART_CHARS)
            path += f".{part}" if path else part
    return path


def _param_of(loc: Sequence) -> str | None:
    """The field a location names, without the leading "body" (None for the body as a whole)."""
    if not loc:
        return None
    if loc[0] == "body":
        loc = loc[1:]
    return _loc_path(loc) or None


def _problem_text(error: dict) -> str:
    msg = str(error.get("msg", "invalid value"))
    # Our own validators raise ValueError; pydantic prefixes its text with "Value error, ".
    msg = msg.removeprefix("Value error, ")
    return f"{_loc_path(error.get('loc', ()))}: {_shorten(msg, 200)}"


def validation_message(errors: Sequence[dict]) -> tuple[str, str | None]:
    """The 400 message and param for pydantic errors, naming fields but never their input values."""
    if not errors:
        return "the request is invalid", None
    for error in errors:
        if error.get("type") == "json_invalid":
            return "the request body is not valid JSON", None
    first = errors[0]
    if tuple(first.get("loc", ())) == ("body",):
        kind = first.get("type")
        if kind == "missing":
            return "the request body is missing", None
        if kind in ("model_attributes_type", "model_type", "dict_type"):
            # FastAPI hands the raw bytes over when the Content-Type is not JSON.
            if isinstance(first.get("input"), (bytes, bytearray)):
                return "the request body must be a JSON object sent with Content-Type: application/json", None
            return "the request body must be a JSON object", None
    shown = [_problem_text(e) for e in errors[:MAX_VALIDATION_PROBLEMS]]
    message = "; ".join(shown)
    if len(errors) > MAX_VALIDATION_PROBLEMS:
        message += f" (and {len(errors) - MAX_VALIDATION_PROBLEMS} more)"
    return message, _param_of(tuple(first.get("loc", ())))


# ---- handlers -----------------------------------------------------------------------------------

async def _api_error_handler(request: Request, exc: APIError) -> Response:
    return exc.response()


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> Response:
    message, param = validation_message(exc.errors())
    return error_response(400, message, param=param)


async def _http_exception_handler(request: Request, exc: StarletteHTTPException) -> Response:
    headers = getattr(exc, "headers", None)
    if exc.status_code < 400:  # not an error (e.g. 304): nothing to put in a body
        return Response(status_code=exc.status_code, headers=headers)
    try:
        phrase = http.HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "error"
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail else phrase
    if detail == phrase and exc.status_code == 404:
        detail = f"no such route: {request.method} {request.url.path}"
    elif detail == phrase and exc.status_code == 405:
        detail = f"method {request.method} is not allowed for {request.url.path}"
    return error_response(exc.status_code, detail, headers=headers)


async def _unexpected_error_handler(request: Request, exc: Exception) -> Response:
    # The traceback goes to the log only: it may hold paths, prompts or internals.
    logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Give every error `app` can produce an OpenAI-style body (see the module docstring)."""
    app.add_exception_handler(APIError, _api_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_error_handler)
    # fastapi.HTTPException subclasses Starlette's, so this one covers both.
    app.add_exception_handler(StarletteHTTPException, _http_exception_handler)
    # Starlette runs the `Exception` handler in its outermost middleware, then re-raises for the
    # server's own log; the client gets only this body.
    app.add_exception_handler(Exception, _unexpected_error_handler)
