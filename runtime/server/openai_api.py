"""OpenAI's routes: /v1/chat/completions, /v1/completions, /v1/models.

Streams are SSE ``data:`` lines ending with ``data: [DONE]``; with
``stream_options.include_usage`` a last chunk with ``choices: []`` carries the usage after the
finish_reason chunk. Usage always reports ``prompt_tokens_details.cached_tokens``: the prompt
tokens kept from the previous request. Responses (and a stream's finish chunk) also carry
llama-server's ``timings`` (prompt and generation times), which clients ignore or show.
"""
from __future__ import annotations

import json
import time

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from .engine import Outcome
from .errors import ApiError, Dialect, error_body
from .generation import (Collected, complete, conversation, new_id, prompt_for, raw_prompt, sampling, served_of, start,
                         stop_list, streamed, structured)
from .http import DialectRoute, check_api_key, read_json
from .messages import from_openai_chat, openai_chat_output_schema
from .output import ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .schemas import ChatCompletionRequest, CompletionRequest, StreamOptions, parse
from .stream import Finished, Started

router = APIRouter(route_class=DialectRoute, dependencies=[Depends(check_api_key)])

def usage(o: Outcome) -> dict:
    return {"prompt_tokens": o.prompt_tokens, "completion_tokens": o.completion_tokens,
            "total_tokens": o.prompt_tokens + o.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": o.cached_tokens}}


def timings(o: Outcome) -> dict:
    """llama-server's ``timings`` object (chat UIs show it; benchmarks split a request's time with
    it): the prompt tokens computed (``cache_n`` kept apart) and their time, the generated tokens
    and the time of the decode steps after the first (the first comes from the prompt's logits)."""
    computed = o.prompt_tokens - o.cached_tokens
    prompt_ms, predicted_ms = o.prefill_seconds * 1e3, o.decode_seconds * 1e3
    steps = max(o.completion_tokens - 1, 0)
    return {"cache_n": o.cached_tokens, "prompt_n": computed, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / computed if computed else 0.0,
            "prompt_per_second": computed / o.prefill_seconds if o.prefill_seconds > 0 else 0.0,
            "predicted_n": o.completion_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / steps if steps else 0.0,
            "predicted_per_second": steps / o.decode_seconds if o.decode_seconds > 0 else 0.0,
            **(o.split.timings() if o.split is not None else {})}


def finish_reason(o: Outcome, tool_calls: bool) -> str:
    if o.finish == "length":
        return "length"
    return "tool_calls" if tool_calls else "stop"


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
    constraint = await structured(served, openai_chat_output_schema, body, "response_format")
    prompt = prompt_for(served, conversation(request, from_openai_chat, body), constraint)
    max_tokens = body.max_completion_tokens or body.max_tokens
    job, stream = start(served, prompt, max_tokens, sampling(served, body), stop_list(body.stop), body)
    chunks = Chunks("chat.completion.chunk", body.model or served.name, body.stream_options)
    if not body.stream:
        out = await complete(served, "chat", request, job, stream)
        return JSONResponse(chat_completion(chunks, out))
    return streamed(served, "chat", request, job, stream, chunks)


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
    chunks = Chunks("text_completion", body.model or served.name, body.stream_options)
    if not body.stream:
        out = await complete(served, "completions", request, job, stream)
        o = out.finished.outcome
        return JSONResponse({**chunks.head(), "choices": [
            {"index": 0, "text": out.text, "logprobs": None, "finish_reason": finish_reason(o, False)}],
            "usage": usage(o), "timings": timings(o)})
    return streamed(served, "completions", request, job, stream, chunks)


class Chunks:
    """OpenAI's stream of one response (``generation.StreamFormat``): ``chat.completion.chunk``
    objects carrying a ``delta``, or ``text_completion`` ones carrying ``text``; the finish
    chunk, the usage chunk (``choices: []``) when asked, then ``[DONE]``."""

    def __init__(self, obj: str, model: str, options: StreamOptions | None):
        self.chat = obj == "chat.completion.chunk"
        self.obj, self.model = obj, model
        self.id = new_id("chatcmpl-" if self.chat else "cmpl-")
        self.created = int(time.time())
        self.include_usage = bool(options and options.include_usage)
        self.calls = 0

    def head(self) -> dict:
        return {"id": self.id, "object": self.obj, "created": self.created, "model": self.model}

    def chunk(self, part: dict | str | None, finish: str | None = None, use: dict | None = None,
              timed: dict | None = None) -> str:
        choices = [] if part is None else [{"index": 0, "delta" if self.chat else "text": part, "logprobs": None,
                                            "finish_reason": finish}]
        c = {**self.head(), "choices": choices}
        if self.include_usage:
            c["usage"] = use
        if timed is not None:
            c["timings"] = timed
        return json.dumps(c, ensure_ascii=False)

    def opening(self) -> list[str]:
        return [self.chunk({"role": "assistant", "content": ""})] if self.chat else []

    def started(self, started: Started) -> list[str]:
        return []

    def events(self, events: list) -> list[str]:
        if not self.chat:
            text = "".join(ev.text for ev in events if isinstance(ev, TextDelta))
            return [self.chunk(text)] if text else []
        self.calls += sum(isinstance(ev, ToolCallEnd) for ev in events)
        return [self.chunk(delta) for delta in map(chat_delta, events) if delta]

    def finished(self, finished: Finished) -> list[str]:
        o = finished.outcome
        out = [self.chunk({} if self.chat else "", finish_reason(o, self.calls > 0), timed=timings(o))]
        if self.include_usage:
            out.append(self.chunk(None, use=usage(o)))
        return out + ["[DONE]"]

    def error(self, err: ApiError) -> list[str]:
        return [json.dumps(error_body(Dialect.OPENAI, err)), "[DONE]"]


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


def chat_completion(chunks: Chunks, out: Collected) -> dict:
    o = out.finished.outcome
    message: dict = {"role": "assistant", "content": out.text if out.text or not out.tool_calls else None}
    if out.reasoning:
        message["reasoning_content"] = message["reasoning"] = out.reasoning
    if out.tool_calls:
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json}} for c in out.tool_calls]
    return {**chunks.head(), "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": None,
                         "finish_reason": finish_reason(o, bool(out.tool_calls))}],
            "usage": usage(o), "timings": timings(o)}
