"""Anthropic's routes: /v1/messages (Claude Code's) and /v1/messages/count_tokens.

A stream is message_start, then per content block (thinking, text, tool_use) its
content_block_start, deltas (thinking_delta, text_delta, input_json_delta) and content_block_stop,
then message_delta (stop_reason, output usage) and message_stop; ``ping`` events go out right after
message_start and every 15 s. Usage splits the prompt as Anthropic does: ``input_tokens`` computed,
``cache_read_input_tokens`` kept from the previous request.
"""
from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent

from .engine import Outcome
from .errors import ApiError, Dialect, error_body
from .generation import (Collected, complete, conversation, new_id, prompt_for, sampling, served_of, start, streamed,
                         structured)
from .http import DialectRoute, check_api_key, read_json
from .messages import anthropic_output_schema, from_anthropic
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
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


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> JSONResponse:
    served = served_of(request)
    body = parse(CountTokensRequest, await read_json(request))
    return JSONResponse({"input_tokens": len(prompt_for(served, conversation(request, from_anthropic, body)).ids)})


@router.post("/v1/messages")
async def messages(request: Request):
    served = served_of(request)
    body = parse(MessagesRequest, await read_json(request))
    given = "output_config.format" if (body.output_config or {}).get("format") is not None else "output_format"
    constraint = await structured(served, anthropic_output_schema, body, given)
    prompt = prompt_for(served, conversation(request, from_anthropic, body), constraint)
    job, stream = start(served, prompt, body.max_tokens, sampling(served, body), body.stop_sequences or [], body)
    events = Events(body.model or served.name)
    if not body.stream:
        return JSONResponse(message(events, await complete(served, "messages", request, job, stream)))
    return streamed(served, "messages", request, job, stream, events, lambda: events.event("ping", {}))


class Events:
    """Anthropic's stream of one message (``generation.StreamFormat``): one content block open at a
    time, opened by the first event of its kind and closed by the next kind or the end."""

    def __init__(self, model: str):
        self.id, self.model = new_id("msg_"), model
        self.index, self.open, self.calls, self.began = -1, None, 0, False

    def event(self, kind: str, data: dict) -> ServerSentEvent:
        return ServerSentEvent(data=json.dumps({"type": kind, **data}, ensure_ascii=False), event=kind)

    def message_start(self, counts: Outcome | Started) -> list[ServerSentEvent]:
        self.began = True
        return [self.event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": usage(counts)}}), self.event("ping", {})]

    def close(self) -> list[ServerSentEvent]:
        if self.open is None:
            return []
        self.open = None
        return [self.event("content_block_stop", {"index": self.index})]

    def block(self, kind: str, block: dict) -> list[ServerSentEvent]:
        """Open a block of ``kind`` unless one is open (a tool_use block is always new)."""
        if self.open == kind and kind != "tool_use":
            return []
        out = self.close()
        self.index += 1
        self.open = kind
        return out + [self.event("content_block_start", {"index": self.index, "content_block": block})]

    def delta(self, delta: dict) -> ServerSentEvent:
        return self.event("content_block_delta", {"index": self.index, "delta": delta})

    def opening(self) -> list:
        return []

    def started(self, started: Started) -> list[ServerSentEvent]:
        return self.message_start(started)

    def events(self, events: list) -> list[ServerSentEvent]:
        out: list[ServerSentEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                out += self.block("text", {"type": "text", "text": ""})
                out.append(self.delta({"type": "text_delta", "text": ev.text}))
            elif isinstance(ev, ReasoningDelta):
                out += self.block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self.delta({"type": "thinking_delta", "thinking": ev.text}))
            elif isinstance(ev, ToolCallStart):
                out += self.block("tool_use", {"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            elif isinstance(ev, ToolCallDelta):
                out.append(self.delta({"type": "input_json_delta", "partial_json": ev.arguments}))
            elif isinstance(ev, ToolCallEnd):
                self.calls += 1
                out += self.close()
        return out

    def finished(self, finished: Finished) -> list[ServerSentEvent]:
        o = finished.outcome
        out = [] if self.began else self.message_start(o)
        return out + self.close() + [
            self.event("message_delta", {"delta": {"stop_reason": stop_reason(finished, self.calls > 0),
                                                   "stop_sequence": finished.stop_sequence},
                                         "usage": usage(o, o.completion_tokens)}),
            self.event("message_stop", {})]

    def error(self, err: ApiError) -> list[ServerSentEvent]:
        out = [] if self.began else self.message_start(Started(0, 0))
        return out + [ServerSentEvent(data=json.dumps(error_body(Dialect.ANTHROPIC, err)), event="error")]


def message(events: Events, out: Collected) -> dict:
    content: list[dict] = []
    if out.reasoning:
        content.append({"type": "thinking", "thinking": out.reasoning, "signature": ""})
    if out.text or not (out.reasoning or out.tool_calls):
        content.append({"type": "text", "text": out.text})
    for c in out.tool_calls:
        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments})
    f = out.finished
    return {"id": events.id, "type": "message", "role": "assistant", "model": events.model, "content": content,
            "stop_reason": stop_reason(f, bool(out.tool_calls)), "stop_sequence": f.stop_sequence,
            "usage": usage(f.outcome, f.outcome.completion_tokens)}
