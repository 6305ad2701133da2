"""The FastAPI application: the dialect routers plus health, metrics and the tokenizer routes.

``app.state.served`` is None while the model loads (``/health`` answers 503, generation routes
503 in their dialect) and the ``generation.Served`` once it is ready.
"""
from __future__ import annotations

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import anthropic_api, openai_api, responses_api
from ..options import ServeOptions
from .errors import ApiError
from .generation import served_of
from .http import DialectRoute, answer_error, check_api_key, read_json
from .metrics import CONTENT_TYPE
from .request_log import RequestRecord, client_name
from .schemas import DetokenizeRequest, TokenizeRequest, parse

local = APIRouter(route_class=DialectRoute)


@local.get("/health")
async def health(request: Request) -> JSONResponse:
    served = request.app.state.served
    if served is None:
        return JSONResponse({"status": "loading"}, status_code=503)
    if not served.engine.alive:  # (a supervisor restarts it; requests are refused meanwhile)
        return JSONResponse({"status": "error", "error": "the engine has stopped"}, status_code=503)
    return JSONResponse({"status": "ok"})


@local.get("/metrics")
def metrics(request: Request) -> Response:
    """A plain function, which FastAPI runs in its thread pool: the counts wait for the
    conversation cache's lock, which a snapshot holds while it takes slots, and on the event
    loop that wait would stall every stream."""
    served = served_of(request)
    return Response(served.metrics.render(served.engine.waiting), media_type=CONTENT_TYPE)


@local.post("/tokenize", dependencies=[Depends(check_api_key)])
async def tokenize(request: Request) -> JSONResponse:
    """llama.cpp server's shape: ``{"content", "add_special"}`` -> ``{"tokens"}``."""
    served = served_of(request)
    body = parse(TokenizeRequest, await read_json(request))
    return JSONResponse({"tokens": served.tokenizer.encode(body.content, add_special=body.add_special)})


@local.post("/detokenize", dependencies=[Depends(check_api_key)])
async def detokenize(request: Request) -> JSONResponse:
    served = served_of(request)
    body = parse(DetokenizeRequest, await read_json(request))
    n = served.tokenizer.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < n]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{n - 1})", "tokens")
    return JSONResponse({"content": served.tokenizer.decode(body.tokens)})


def create_app(options: ServeOptions) -> FastAPI:
    app = FastAPI(title="sparkpack", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.options = options
    app.state.served = None
    for router in (local, openai_api.router, responses_api.router, anthropic_api.router):
        app.include_router(router)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Unknown routes and wrong methods, in the dialect their path suggests (and logged)."""
        message = f"{request.method} {request.url.path}: {exc.detail}"
        record = RequestRecord(request.method, request.url.path, client_name(request.headers.get("user-agent")))
        response = answer_error(request, record, ApiError(exc.status_code, message))
        record.write()
        return response

    return app
