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
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from sse_starlette.sse import ServerSentEvent

from .messages import RequestError, from_responses
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .errors import Dialect, error_body
from .generation import Collected, Served, collect, failed, new_id, prompt_for, request_error, sampling, start
from .http import DialectRoute, check_api_key, read_json
from .openai_api import served_of, sse
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
    try:
        conv = from_responses(body.model_dump(exclude_unset=False))
    except RequestError as e:
        raise request_error(e) from None
    prompt = prompt_for(served, conv)
    job, stream = start(served, prompt, body.max_output_tokens, sampling(served, body), [], body, param="input")
    rid, created, model = new_id("resp_"), int(time.time()), body.model or served.name

    def response(status: str, output: list[dict], finished: Finished | None = None, reasoning: str = "") -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "model": model,
                "output": output, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "parallel_tool_calls": True, "tool_choice": conv.tool_choice, "tools": body.tools or [],
                "temperature": body.temperature, "top_p": body.top_p, "text": {"format": {"type": "text"}},
                "reasoning": body.reasoning or {}, "store": False, "metadata": {},
                "usage": usage(served, finished, reasoning) if finished is not None else None}

    def status_of(finished: Finished) -> str:
        return "incomplete" if finished.outcome.finish == "length" else "completed"

    if not body.stream:
        out = await collect(request.receive, job, stream)
        served.metrics.requests.labels("responses", out.finished.outcome.finish).inc()
        err = failed(out.finished)
        if err:
            raise err
        return JSONResponse(response(status_of(out.finished), output_items(out), out.finished, out.reasoning))

    async def events() -> AsyncIterator[ServerSentEvent]:
        seq = 0
        output: list[dict] = []  # finished items
        current: dict | None = None  # the open item: kind, id, text, (call_id, name)
        reasoning = ""
        outcome = "cancelled"

        def event(kind: str, **data) -> ServerSentEvent:
            nonlocal seq
            seq += 1
            return ServerSentEvent(data=json.dumps({"type": kind, "sequence_number": seq, **data}, ensure_ascii=False),
                                   event=kind)

        def where() -> dict:
            return {"item_id": current["id"], "output_index": len(output)}

        def close() -> list[ServerSentEvent]:
            nonlocal current
            if current is None:
                return []
            c, out = current, []
            if c["kind"] == "message":
                part = {"type": "output_text", "text": c["text"], "annotations": [], "logprobs": []}
                item = message_item(c["id"], c["text"])
                out += [event("response.output_text.done", **where(), content_index=0, text=c["text"], logprobs=[]),
                        event("response.content_part.done", **where(), content_index=0, part=part)]
            elif c["kind"] == "reasoning":
                part = {"type": "reasoning_text", "text": c["text"]}
                item = reasoning_item(c["id"], c["text"])
                out += [event("response.reasoning_text.done", **where(), content_index=0, text=c["text"]),
                        event("response.content_part.done", **where(), content_index=0, part=part)]
            else:
                item = call_item(c["id"], c["call_id"], c["name"], c["text"])
                out.append(event("response.function_call_arguments.done", **where(), arguments=c["text"],
                                 name=c["name"]))
            out.append(event("response.output_item.done", output_index=len(output), item=item))
            output.append(item)
            current = None
            return out

        def open_item(kind: str, **extra) -> list[ServerSentEvent]:
            nonlocal current
            out = close()
            current = {"kind": kind, "id": new_id({"message": "msg_", "reasoning": "rs_"}.get(kind, "fc_")),
                       "text": "", **extra}
            if kind == "message":
                item = message_item(current["id"], "", "in_progress")
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            elif kind == "reasoning":
                item, part = reasoning_item(current["id"], None), {"type": "reasoning_text", "text": ""}
            else:
                item, part = call_item(current["id"], extra["call_id"], extra["name"], "", "in_progress"), None
            out.append(event("response.output_item.added", output_index=len(output), item=item))
            if part is not None:
                out.append(event("response.content_part.added", **where(), content_index=0, part=part))
            return out

        try:
            yield event("response.created", response=response("in_progress", []))
            yield event("response.in_progress", response=response("in_progress", []))
            async for item in stream.events():
                if isinstance(item, Started):
                    continue
                if isinstance(item, Finished):
                    outcome = item.outcome.finish
                    err = failed(item)
                    if err:
                        yield ServerSentEvent(data=json.dumps({"type": "error", "sequence_number": seq + 1,
                                                               **error_body(Dialect.OPENAI, err)["error"]}),
                                              event="error")
                        return
                    for e in close():
                        yield e
                    status = status_of(item)
                    yield event(f"response.{status}", response=response(status, output, item, reasoning))
                    return
                for ev in item:
                    out: list[ServerSentEvent] = []
                    if isinstance(ev, TextDelta):
                        if current is None or current["kind"] != "message":
                            out += open_item("message")
                        current["text"] += ev.text
                        out.append(event("response.output_text.delta", **where(), content_index=0, delta=ev.text,
                                         logprobs=[]))
                    elif isinstance(ev, ReasoningDelta):
                        if current is None or current["kind"] != "reasoning":
                            out += open_item("reasoning")
                        current["text"] += ev.text
                        reasoning += ev.text
                        out.append(event("response.reasoning_text.delta", **where(), content_index=0, delta=ev.text))
                    elif isinstance(ev, ToolCallStart):
                        out += open_item("function_call", call_id=ev.id, name=ev.name)
                    elif isinstance(ev, ToolCallDelta):
                        current["text"] += ev.arguments
                        out.append(event("response.function_call_arguments.delta", **where(), delta=ev.arguments))
                    elif isinstance(ev, ToolCallEnd):
                        out += close()
                    for e in out:
                        yield e
        finally:
            job.cancel()
            served.metrics.requests.labels("responses", outcome).inc()

    return sse(events())


def output_items(out: Collected) -> list[dict]:
    items = []
    if out.reasoning:
        items.append(reasoning_item(new_id("rs_"), out.reasoning))
    if out.text or not (out.reasoning or out.tool_calls):
        items.append(message_item(new_id("msg_"), out.text))
    for c in out.tool_calls:
        items.append(call_item(new_id("fc_"), c.id, c.name, c.arguments_json))
    return items
