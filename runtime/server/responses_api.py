"""OpenAI's Responses API, stateless: ``POST /v1/responses`` (what Codex CLI speaks).

Output items in order: a ``reasoning`` item (its text as ``reasoning_text`` content), a ``message``
with ``output_text``, then one ``function_call`` per tool call. A stream announces each item
(``response.output_item.added``), streams its deltas and closes it (``...done``,
``response.output_item.done``) between ``response.created``/``response.in_progress`` and
``response.completed`` (``response.incomplete`` when max_output_tokens or the context ran out).
Nothing is stored: ``previous_response_id`` is refused by ``messages.from_responses``.
"""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent

from .errors import ApiError, Dialect, error_body
from .generation import (Collected, Served, complete, conversation, new_id, prompt_for, sampling, served_of, start,
                         streamed, structured)
from .http import DialectRoute, check_api_key, read_json
from .messages import from_responses, responses_output_schema
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .schemas import ResponsesRequest, parse
from .stream import Finished, Started

router = APIRouter(route_class=DialectRoute, dependencies=[Depends(check_api_key)])


def usage(served: Served, finished: Finished, reasoning: str) -> dict:
    o = finished.outcome
    thought = len(served.tokenizer.encode(reasoning)) if reasoning else 0
    return {"input_tokens": o.prompt_tokens, "input_tokens_details": {"cached_tokens": o.cached_tokens},
            "output_tokens": o.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": min(thought, o.completion_tokens)},
            "total_tokens": o.prompt_tokens + o.completion_tokens}


def message_item(iid: str, text: str, status: str = "completed") -> dict:
    content = [] if status != "completed" else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": iid, "role": "assistant", "status": status, "content": content}


def reasoning_item(iid: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": iid, "summary": [], "content": content}


def call_item(iid: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": iid, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


@router.post("/v1/responses")
async def responses(request: Request):
    served = served_of(request)
    body = parse(ResponsesRequest, await read_json(request))
    conv = conversation(request, from_responses, body)
    prompt = prompt_for(served, conv, await structured(served, responses_output_schema, body, "text.format"))
    job, stream = start(served, prompt, body.max_output_tokens, sampling(served, body), [], body, param="input")
    items = Items(served, body, conv.tool_choice)
    if not body.stream:
        out = await complete(served, "responses", request, job, stream)
        return JSONResponse(items.response(status_of(out.finished), output_items(out), out.finished, out.reasoning))
    return streamed(served, "responses", request, job, stream, items)


def status_of(finished: Finished) -> str:
    return "incomplete" if finished.outcome.finish == "length" else "completed"


class Items:
    """The Responses API's stream of one response (``generation.StreamFormat``): each output
    item announced, streamed and closed in turn, every event numbered (``sequence_number``)."""

    def __init__(self, served: Served, body: ResponsesRequest, tool_choice: str | dict):
        self.served, self.body, self.tool_choice = served, body, tool_choice
        self.id, self.created = new_id("resp_"), int(time.time())
        self.seq = 0
        self.output: list[dict] = []  # the finished items
        self.current: dict | None = None  # the open item: kind, id, text (and call_id, name)
        self.reasoning = ""

    def response(self, status: str, output: list[dict], finished: Finished | None = None, reasoning: str = "") -> dict:
        b = self.body
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": b.model or self.served.name, "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
                "parallel_tool_calls": True, "tool_choice": self.tool_choice, "tools": b.tools or [],
                "temperature": b.temperature, "top_p": b.top_p, "text": b.text or {"format": {"type": "text"}},
                "reasoning": b.reasoning or {}, "store": False, "metadata": {},
                "usage": usage(self.served, finished, reasoning) if finished is not None else None}

    def event(self, kind: str, **data) -> ServerSentEvent:
        self.seq += 1
        return ServerSentEvent(data=json.dumps({"type": kind, "sequence_number": self.seq, **data},
                                               ensure_ascii=False), event=kind)

    def where(self) -> dict:
        return {"item_id": self.current["id"], "output_index": len(self.output)}

    def close(self) -> list[ServerSentEvent]:
        c = self.current
        if c is None:
            return []
        out = []
        if c["kind"] == "message":
            part = {"type": "output_text", "text": c["text"], "annotations": [], "logprobs": []}
            item = message_item(c["id"], c["text"])
            out += [self.event("response.output_text.done", **self.where(), content_index=0, text=c["text"],
                               logprobs=[]),
                    self.event("response.content_part.done", **self.where(), content_index=0, part=part)]
        elif c["kind"] == "reasoning":
            part = {"type": "reasoning_text", "text": c["text"]}
            item = reasoning_item(c["id"], c["text"])
            out += [self.event("response.reasoning_text.done", **self.where(), content_index=0, text=c["text"]),
                    self.event("response.content_part.done", **self.where(), content_index=0, part=part)]
        else:
            item = call_item(c["id"], c["call_id"], c["name"], c["text"])
            out.append(self.event("response.function_call_arguments.done", **self.where(), arguments=c["text"],
                                  name=c["name"]))
        out.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.current = None
        return out

    def item(self, kind: str, **extra) -> list[ServerSentEvent]:
        """Open an item of ``kind`` unless one is open (a function call is always new)."""
        if self.current is not None and self.current["kind"] == kind and kind != "function_call":
            return []
        out = self.close()
        iid = new_id({"message": "msg_", "reasoning": "rs_"}.get(kind, "fc_"))
        self.current = {"kind": kind, "id": iid, "text": "", **extra}
        if kind == "message":
            item, part = message_item(iid, "", "in_progress"), {"type": "output_text", "text": "", "annotations": [],
                                                                "logprobs": []}
        elif kind == "reasoning":
            item, part = reasoning_item(iid, None), {"type": "reasoning_text", "text": ""}
        else:
            item, part = call_item(iid, extra["call_id"], extra["name"], "", "in_progress"), None
        out.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if part is not None:
            out.append(self.event("response.content_part.added", **self.where(), content_index=0, part=part))
        return out

    def opening(self) -> list[ServerSentEvent]:
        return [self.event(kind, response=self.response("in_progress", []))
                for kind in ("response.created", "response.in_progress")]

    def started(self, started: Started) -> list:
        return []

    def events(self, events: list) -> list[ServerSentEvent]:
        out: list[ServerSentEvent] = []
        for ev in events:
            if isinstance(ev, TextDelta):
                out += self.item("message")
                self.current["text"] += ev.text
                out.append(self.event("response.output_text.delta", **self.where(), content_index=0, delta=ev.text,
                                      logprobs=[]))
            elif isinstance(ev, ReasoningDelta):
                out += self.item("reasoning")
                self.current["text"] += ev.text
                self.reasoning += ev.text
                out.append(self.event("response.reasoning_text.delta", **self.where(), content_index=0, delta=ev.text))
            elif isinstance(ev, ToolCallStart):
                out += self.item("function_call", call_id=ev.id, name=ev.name)
            elif isinstance(ev, ToolCallDelta):
                self.current["text"] += ev.arguments
                out.append(self.event("response.function_call_arguments.delta", **self.where(), delta=ev.arguments))
            elif isinstance(ev, ToolCallEnd):
                out += self.close()
        return out

    def finished(self, finished: Finished) -> list[ServerSentEvent]:
        status = status_of(finished)
        return self.close() + [self.event(f"response.{status}",
                                          response=self.response(status, self.output, finished, self.reasoning))]

    def error(self, err: ApiError) -> list[ServerSentEvent]:
        self.seq += 1
        return [ServerSentEvent(data=json.dumps({"type": "error", "sequence_number": self.seq,
                                                 **error_body(Dialect.OPENAI, err)["error"]}), event="error")]


def output_items(out: Collected) -> list[dict]:
    items = []
    if out.reasoning:
        items.append(reasoning_item(new_id("rs_"), out.reasoning))
    if out.text or not (out.reasoning or out.tool_calls):
        items.append(message_item(new_id("msg_"), out.text))
    for c in out.tool_calls:
        items.append(call_item(new_id("fc_"), c.id, c.name, c.arguments_json))
    return items
