"""HTTP plumbing every route shares: reading a JSON body safely, the API key, and turning any
failure into one JSON error in the route's dialect.

Bodies are read here rather than by FastAPI so that every way a body can be wrong (too large, not
UTF-8, not JSON, not an object) gets the same one-line 4xx in the right dialect. An unexpected
exception becomes a 500 whose message is its first line, logged once with its traceback, and the
server goes on serving. Every request gets its log line (``request_log``) and, when placeholders
stand for parts the model cannot read, the ``x-sparkpack-omitted`` header.
"""
from __future__ import annotations

import hmac
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from .errors import ApiError, client_message, dialect_of, error_body
from .request_log import OMITTED_HEADER, RequestRecord, client_name, omitted_text

log = logging.getLogger("sparkpack.server")

MAX_BODY_BYTES = 32 * 1024**2  # a 256k-token conversation is ~1 MB of JSON; tool results can be large
PING_SECONDS = 15  # SSE pings keep idle proxies from closing a stream during a long prefill
SHUTDOWN_GRACE_SECONDS = 5


def error_response(path: str, err: ApiError) -> JSONResponse:
    return JSONResponse(error_body(dialect_of(path), err), status_code=err.status)


def answer_error(request: Request, record: RequestRecord, err: ApiError) -> JSONResponse:
    """The error response, its status and message noted for the request's log line."""
    record.status, record.error = err.status, client_message(dialect_of(request.url.path), err)
    return error_response(request.url.path, err)


class DialectRoute(APIRoute):
    """A route whose failures answer in its dialect (``ApiError``), internal errors included;
    each request is logged once (a stream when it ends: ``generation.relay``)."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            record = request.state.record = RequestRecord(request.method, request.url.path,
                                                          client_name(request.headers.get("user-agent")))
            try:
                response = await handler(request)
                record.status = response.status_code
            except ApiError as e:
                response = answer_error(request, record, e)
            except Exception as e:
                log.exception("internal error on %s", request.url.path)
                line = (str(e).splitlines() or [""])[0]
                response = answer_error(request, record, ApiError(500, f"internal error: {type(e).__name__}: {line}"))
            if record.omitted:
                response.headers[OMITTED_HEADER] = omitted_text(record.omitted)
            if not record.streamed:
                record.write()
            return response

        return guarded


async def read_json(request: Request) -> Any:
    limit = MAX_BODY_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request body has {int(declared)} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request body is over the limit of {limit} bytes")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def check_api_key(request: Request) -> None:
    """``Authorization: Bearer K`` (OpenAI clients) or ``x-api-key: K`` (Anthropic's)."""
    key = request.app.state.options.api_key  # runtime.options.ServeOptions
    if key is None:
        return
    sent = request.headers.get("x-api-key")
    auth = request.headers.get("authorization", "")
    if sent is None and auth.lower().startswith("bearer "):
        sent = auth[7:].strip()
    if sent is None or not hmac.compare_digest(sent.encode(), key.encode()):
        raise ApiError(401, "invalid or missing API key (send Authorization: Bearer KEY or x-api-key: KEY)",
                       code="invalid_api_key")


def sse(items: AsyncIterator, ping_event: Callable[[], ServerSentEvent] | None = None) -> EventSourceResponse:
    """An SSE response (``ping_event``: the dialect's ping, else an SSE comment). On shutdown the
    engine cancels the job, so a stream ends by itself with its last events within a token;
    sse-starlette's cut comes only after a grace period."""
    return EventSourceResponse(items, ping=PING_SECONDS, sep="\n", ping_message_factory=ping_event,
                               shutdown_grace_period=SHUTDOWN_GRACE_SECONDS)
