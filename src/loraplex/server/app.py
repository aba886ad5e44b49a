"""The FastAPI app: OpenAI's completions, chat and models endpoints, health, version, metrics, the
OpenAPI schema (/openapi.json, /docs), and the adapter routes (adapters_api.py: loraplex's
/v1/adapters and vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter). `create_app(state)`
builds it around a running `AsyncEngine`.

Every adapter is a model: a request's `model` names the base model or any served adapter, among
those the caller's key may use (tenants.py; guards.py says which key each route takes).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from .. import __version__
from .adapters_api import router as adapters_router
from .compositions_api import composition_models
from .errors import APIError, install_error_handlers
from .generation import Run, prepare
from .guards import Authenticator, Guard, access_of
from .protocol import ChatCompletionRequest, CompletionRequest
from .respond import respond_stream, respond_whole, start_stream
from .state import ServerState
from .targets import requested_label

log = logging.getLogger("loraplex.server")

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}   # proxies must not buffer the stream


def create_app(state: ServerState, *, lifespan=None) -> FastAPI:
    app = FastAPI(title="loraplex", summary="OpenAI-compatible multi-LoRA server", version=__version__,
                  lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.state.loraplex = state
    install_error_handlers(app)
    settings = state.settings
    app.add_middleware(Guard, limit=settings.max_body_bytes,
                       auth=Authenticator(settings.api_key, settings.admin_key, state.keyring,
                                          settings.metrics_require_key))
    app.include_router(adapters_router)

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return JSONResponse({"status": "error", "detail": "the engine is not running"}, status_code=503)
        if not state.accepting:   # load balancers stop routing here while requests in flight finish
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        access = access_of(request)
        # max_model_len as vLLM reports it: clients size prompts and max_tokens from it
        data = []
        if access.base_model:
            data.append({"id": state.model_name, "object": "model", "created": state.created, "owned_by": "loraplex",
                         "root": state.model_name, "parent": None, "max_model_len": state.max_model_len})
        for name in state.visible_adapters(access):
            data.append({"id": name, "object": "model", "created": state.adapters[name].created,
                         "owned_by": "loraplex", "root": name, "parent": state.model_name,
                         "max_model_len": state.max_model_len})
        data += composition_models(state, access)   # named compositions, with their members in `compose`
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def model(request: Request, model_id: str) -> dict:
        listed = await models(request)
        for entry in listed["data"]:
            if entry["id"] == model_id:
                return entry
        raise APIError(404, f"the model {model_id!r} does not exist", param="model", code="model_not_found")

    @app.post("/v1/completions")
    async def completions(request: Request, body: CompletionRequest) -> Response:
        return await _generate(state, request, body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, body: ChatCompletionRequest) -> Response:
        return await _generate(state, request, body, chat=True)

    return app


async def _generate(state: ServerState, request: Request, body, chat: bool) -> Response:
    access = access_of(request)
    adapter = requested_label(state, body)
    try:
        prep = await prepare(state, body, chat, access)
        run = Run(state, prep)
        await run.submit()
    except APIError as e:   # refused before it ran: counted by adapter (unknown names count as "other")
        state.metrics.request_rejected(adapter, e.status, access.tenant)
        raise
    if prep.stream:   # (a failure before its first output is counted by the run, as whole responses' are)
        await start_stream(run, request)
        return StreamingResponse(respond_stream(run), media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(run.close))
    return JSONResponse(await respond_whole(run, request))
