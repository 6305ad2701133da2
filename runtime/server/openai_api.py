"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models.

Streams are SSE ``data:`` lines ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk with ``choices: []`` carries the usage after the
finish_reason chunk. Usage always reports ``prompt_tokens_details.cached_tokens``: the prompt
tokens kept from the previous request.
"""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import EventSourceResponse, ServerSentEvent

from .messages import RequestError, from_openai_chat
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .engine import Outcome
from .errors import ApiError, Dialect, error_body
from .generation import (Collected, Served, collect, failed, new_id, prompt_for, raw_prompt, request_error, sampling,
                         start, stop_list)
from .http import DialectRoute, check_api_key, read_json
from .schemas import ChatCompletionRequest, CompletionRequest, parse
from .stream import Finished, Started

router = APIRouter(route_class=DialectRoute, dependencies=[Depends(check_api_key)])

PING_SECONDS = 15  # SSE comment lines keep idle proxies from closing a stream during a long prefill
SHUTDOWN_GRACE_SECONDS = 5


def served_of(request: Request) -> Served:
    served = request.app.state.served
    if served is None:
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200")
    return served


def usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def finish_reason(o: Outcome, tool_calls: bool) -> str:
    if o.finish == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


def sse(items: AsyncIterator, ping_event: Callable[[], ServerSentEvent] | None = None) -> EventSourceResponse:
    """An SSE response. On shutdown the engine cancels the job, so a stream ends by itself with its
    last events within a token; sse-starlette's cut comes only after a grace period."""
    return EventSourceResponse(items, ping=PING_SECONDS, sep="\n", ping_message_factory=ping_event,
                               shutdown_grace_period=SHUTDOWN_GRACE_SECONDS)


def error_event(err: ApiError) -> str:
    return json.dumps(error_body(Dialect.OPENAI, err))


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    served = served_of(request)
    return JSONResponse({"object": "list", "data": [{
        "id": served.name, "object": "model", "created": served.created, "owned_by": "sparkpack",
        "context_length": served.ctx, "max_model_len": served.ctx}]})


@router.post("/v1/chat/completions")
async def chat_completions(request: Request):
    served = served_of(request)
    body = parse(ChatCompletionRequest, await read_json(request))
    try:
        conv = from_openai_chat(body.model_dump(exclude_unset=False))
    except RequestError as e:
        raise request_error(e) from None
    prompt = prompt_for(served, conv)
    max_tokens = body.max_completion_tokens or body.max_tokens
    job, stream = start(served, prompt, max_tokens, sampling(served, body), stop_list(body.stop), body)
    rid, created, model = new_id("chatcmpl-"), int(time.time()), body.model or served.name
    if not body.stream:
        out = await collect(request.receive, job, stream)
        served.metrics.requests.labels("chat", out.finished.outcome.finish).inc()
        err = failed(out.finished)
        if err:
            raise err
        return JSONResponse(chat_completion(rid, created, model, out, prompt.tools))
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(delta: dict | None, finish: str | None = None, use: dict | None = None) -> str:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
        c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = use
        return json.dumps(c, ensure_ascii=False)

    async def events() -> AsyncIterator[str]:
        calls = 0
        outcome = "cancelled"
        try:
            yield chunk({"role": "assistant", "content": ""})
            async for item in stream.events():
                if isinstance(item, Started):
                    continue
                if isinstance(item, Finished):
                    outcome = item.outcome.finish
                    err = failed(item)
                    if err:
                        yield error_event(err)
                    else:
                        yield chunk({}, finish_reason(item.outcome, calls > 0))
                        if include_usage:
                            yield chunk(None, use=usage(item.outcome))
                    yield "[DONE]"
                    return
                for ev in item:
                    if isinstance(ev, ToolCallEnd):
                        calls += 1
                    yield chunk(chat_delta(ev))
        finally:
            job.cancel()
            served.metrics.requests.labels("chat", outcome).inc()

    return sse(events())


def chat_delta(ev) -> dict:
    if isinstance(ev, TextDelta):
        return {"content": ev.text}
    if isinstance(ev, ReasoningDelta):
        return {"reasoning_content": ev.text, "reasoning": ev.text}
    if isinstance(ev, ToolCallStart):
        return {"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                "function": {"name": ev.name, "arguments": ""}}]}
    if isinstance(ev, ToolCallDelta):
        return {"tool_calls": [{"index": ev.index, "function": {"arguments": ev.arguments}}]}
    return {}  # ToolCallEnd: the arguments went as deltas


def chat_completion(rid: str, created: int, model: str, out: Collected, tools: bool) -> dict:
    o = out.finished.outcome
    message: dict = {"role": "assistant", "content": out.text if out.text or not out.tool_calls else None}
    if out.reasoning:
        message["reasoning_content"] = message["reasoning"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in out.tool_calls]
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(o, bool(out.tool_calls))}],
            "usage": usage(o)}


@router.post("/v1/completions")
async def completions(request: Request):
    served = served_of(request)
    body = parse(CompletionRequest, await read_json(request))
    if body.echo:
        raise ApiError(400, "echo is not supported", "echo")
    if body.suffix:
        raise ApiError(400, "suffix is not supported", "suffix")
    prompt = raw_prompt(served, body.prompt)
    job, stream = start(served, prompt, body.max_tokens, sampling(served, body), stop_list(body.stop), body,
                        param="prompt")
    rid, created, model = new_id("cmpl-"), int(time.time()), body.model or served.name
    if not body.stream:
        out = await collect(request.receive, job, stream)
        served.metrics.requests.labels("completions", out.finished.outcome.finish).inc()
        err = failed(out.finished)
        if err:
            raise err
        o = out.finished.outcome
        return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model,
                             "choices": [{"index": 0, "text": out.text, "logprobs": None,
                                          "finish_reason": finish_reason(o, False)}], "usage": usage(o)})
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def chunk(text: str | None, finish: str | None = None, use: dict | None = None) -> str:
        choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
        c = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
        if include_usage:
            c["usage"] = use
        return json.dumps(c, ensure_ascii=False)

    async def events() -> AsyncIterator[str]:
        outcome = "cancelled"
        try:
            async for item in stream.events():
                if isinstance(item, Started):
                    continue
                if isinstance(item, Finished):
                    outcome = item.outcome.finish
                    err = failed(item)
                    if err:
                        yield error_event(err)
                    else:
                        yield chunk("", finish_reason(item.outcome, False))
                        if include_usage:
                            yield chunk(None, use=usage(item.outcome))
                    yield "[DONE]"
                    return
                text = "".join(ev.text for ev in item if isinstance(ev, TextDelta))
                if text:
                    yield chunk(text)
        finally:
            job.cancel()
            served.metrics.requests.labels("completions", outcome).inc()

    return sse(events())

