"""Anthropic's routes: /v1/messages (Claude Code's) and /v1/messages/count_tokens.

A stream is message_start, then per content block (thinking, text, tool_use) its
content_block_start, deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason, output usage) and message_stop; ``ping`` events go out right after
message_start and every 15 s. Usage splits the prompt as Anthropic does: ``input_tokens`` computed,
``cache_read_input_tokens`` kept from the previous request.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent

from .messages import RequestError, from_anthropic
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .engine import Outcome
from .errors import Dialect, error_body
from .generation import Collected, collect, failed, new_id, prompt_for, request_error, sampling, start
from .http import DialectRoute, check_api_key, read_json
from .openai_api import served_of, sse
from .schemas import CountTokensRequest, MessagesRequest, parse
from .stream import Finished, Started

router = APIRouter(route_class=DialectRoute, dependencies=[Depends(check_api_key)])


def usage(o: Outcome | Started, output_tokens: int = 0) -> dict:
    return {"input_tokens": o.prompt_tokens - o.cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": o.cached_tokens}


def stop_reason(f: Finished, tool_calls: bool) -> str:
    if f.outcome.finish == "length":
        return "max_tokens"
    if f.stop_sequence is not None:
        return "stop_sequence"
    return "tool_use" if tool_calls else "end_turn"


def conversation(body) -> object:
    try:
        return from_anthropic(body.model_dump(exclude_unset=False))
    except RequestError as e:
        raise request_error(e) from None


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    served = served_of(request)
    body = parse(CountTokensRequest, await read_json(request))
    return JSONResponse({"input_tokens": len(prompt_for(served, conversation(body)).ids)})


@router.post("/v1/messages")
async def messages(request: Request):
    served = served_of(request)
    body = parse(MessagesRequest, await read_json(request))
    prompt = prompt_for(served, conversation(body))
    job, stream = start(served, prompt, body.max_tokens, sampling(served, body), body.stop_sequences or [], body)
    mid, model = new_id("msg_"), body.model or served.name
    if not body.stream:
        out = await collect(request.receive, job, stream)
        served.metrics.requests.labels("messages", out.finished.outcome.finish).inc()
        err = failed(out.finished)
        if err:
            raise err
        return JSONResponse(message(mid, model, out))

    def event(kind: str, data: dict) -> ServerSentEvent:
        return ServerSentEvent(data=json.dumps({"type": kind, **data}, ensure_ascii=False), event=kind)

    def message_start(counts: Outcome | Started) -> ServerSentEvent:
        return event("message_start", {"message": {
            "id": mid, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": usage(counts)}})

    async def events() -> AsyncIterator[ServerSentEvent]:
        index, open_kind, calls, began = -1, None, 0, False
        outcome = "cancelled"

        def close() -> list[ServerSentEvent]:
            nonlocal open_kind
            if open_kind is None:
                return []
            open_kind = None
            return [event("content_block_stop", {"index": index})]

        def open_block(kind: str, block: dict) -> list[ServerSentEvent]:
            nonlocal index, open_kind
            out = close()
            index += 1
            open_kind = kind
            return out + [event("content_block_start", {"index": index, "content_block": block})]

        try:
            async for item in stream.events():
                if isinstance(item, Started):
                    began = True
                    yield message_start(item)
                    yield event("ping", {})
                    continue
                if isinstance(item, Finished):
                    outcome = item.outcome.finish
                    if not began:
                        yield message_start(item.outcome)
                    err = failed(item)
                    if err:
                        yield ServerSentEvent(data=json.dumps(error_body(Dialect.ANTHROPIC, err)), event="error")
                        return
                    for e in close():
                        yield e
                    yield event("message_delta", {
                        "delta": {"stop_reason": stop_reason(item, calls > 0), "stop_sequence": item.stop_sequence},
                        "usage": usage(item.outcome, item.outcome.completion_tokens)})
                    yield event("message_stop", {})
                    return
                for ev in item:
                    out = []
                    if isinstance(ev, TextDelta):
                        if open_kind != "text":
                            out += open_block("text", {"type": "text", "text": ""})
                        out.append(event("content_block_delta", {"index": index,
                                                                 "delta": {"type": "text_delta", "text": ev.text}}))
                    elif isinstance(ev, ReasoningDelta):
                        if open_kind != "thinking":
                            out += open_block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                        out.append(event("content_block_delta", {
                            "index": index, "delta": {"type": "thinking_delta", "thinking": ev.text}}))
                    elif isinstance(ev, ToolCallStart):
                        out += open_block("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
                    elif isinstance(ev, ToolCallDelta):
                        out.append(event("content_block_delta", {
                            "index": index, "delta": {"type": "input_json_delta", "partial_json": ev.arguments}}))
                    elif isinstance(ev, ToolCallEnd):
                        calls += 1
                        out += close()
                    for e in out:
                        yield e
        finally:
            job.cancel()
            served.metrics.requests.labels("messages", outcome).inc()

    return sse(events(), lambda: event("ping", {}))


def message(mid: str, model: str, out: Collected) -> dict:
    content: list[dict] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.text or not (out.reasoning or out.tool_calls):
        content.append({"type": "text", "text": out.text})
    for c in out.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
    f = out.finished
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop_reason(f, bool(out.tool_calls)), "stop_sequence": f.stop_sequence,
            "usage": usage(f.outcome, f.outcome.completion_tokens)}
