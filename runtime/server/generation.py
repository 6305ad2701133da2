"""What every generating route shares: the served model, prompt building, starting a job, and
collecting its events (with the client's disconnect cancelling it).

A route turns its body into a ``Conversation`` (``conversation``: B's dialect readers), then
``prompt_for`` renders it with the model's chat template, appends a forced tool-call prefix where
``tool_choice`` asks for one and tokenizes it; ``start`` checks the context and queues the job;
the route answers with the whole response (``complete``) or streams it (``streamed``: ``relay``
driving the dialect's ``StreamFormat``). Both note the job's outcome in the request's log record.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from sparkpack.formats.errors import SparkpackError

from ..chat_template import ChatTemplate
from ..grammar import GrammarConstraint, GrammarError, SchemaGrammars
from ..options import SamplingOptions
from .engine import Engine, Job, Outcome
from .errors import ApiError, anthropic_field, context_exceeded
from .http import sse
from .messages import Conversation, RequestError
from .metrics import ServerMetrics
from .output import (OutputParser, ReasoningDelta, TextDelta, ToolCallEnd, ToolCallStart, ToolSyntax, closed_reasoning,
                     forced_prefix, prompt_opens_reasoning)
from .prompt_tokens import PromptTokens
from .request_log import RequestRecord, record_of
from .schemas import Body, Sampling
from .stream import EventStream, Finished, PlainText, Started

if TYPE_CHECKING:
    from ..learning import LiveLearning
    from ..models.base import MoEModel
    from ..routing_trace import TraceRecorder
    from ..tokenizer import GGUFTokenizer

@dataclass
class Served:
    """The loaded model and everything routes need about it."""

    name: str
    model: MoEModel
    tokenizer: GGUFTokenizer
    template: ChatTemplate | None
    syntax: ToolSyntax
    ctx: int
    defaults: SamplingOptions
    engine: Engine
    metrics: ServerMetrics
    max_tokens: int | None = None  # spark-run --max-tokens: the cap of requests that set none (else the context)
    learning: LiveLearning | None = None  # learns the placement (None without the store)
    trace: TraceRecorder | None = None  # --trace-out
    created: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: PromptTokens = field(init=False)  # rendered prompts' tokens, reused turn to turn
    grammars: SchemaGrammars = field(init=False)  # structured outputs' schemas -> token masks

    def __post_init__(self) -> None:
        self.prompt_tokens = PromptTokens(self.tokenizer)
        self.grammars = SchemaGrammars(self.tokenizer, self.model.spec.n_vocab)


def served_of(request) -> Served:
    """The loaded model, or a retryable 503 while it loads."""
    served = request.app.state.served
    if served is None:
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200")
    return served


@dataclass
class Prompt:
    ids: list[int]
    parser: OutputParser | PlainText
    tools: bool  # tool calls are parsed (finish_reason tool_calls)
    constraint: GrammarConstraint | None = None  # a structured output's grammar


# Stop strings a model needs besides its stop tokens, not reported as the request's own: after tool
# calls Laguna may spell its end-of-turn token as text (llama.cpp stops there too).
IMPLICIT_STOPS = {"laguna": ("</assistant>",)}


def conversation(request, convert: Callable[[dict], Conversation], body: Body) -> Conversation:
    """A validated body through one of ``messages``' dialect readers; its errors are 400s (for
    Anthropic's clients opening with the field, as Anthropic's do). The placeholders it put in
    go to the request's record (the response header and the log line)."""
    try:
        conv = convert(body.model_dump(exclude_unset=False))
    except RequestError as e:
        worded = f"{anthropic_field(e.param)}: {e.message}" if e.param else e.message
        raise ApiError(400, e.message, e.param, e.code, anthropic=worded) from None
    record_of(request).omitted = conv.omitted
    return conv


async def structured(served: Served, read: Callable[[dict], dict | None], body: Body,
                     param: str) -> GrammarConstraint | None:
    """The request's structured-output schema (``read``: one of ``messages``' format readers) as
    a grammar for its reply; a format that is malformed or that llguidance cannot compile is a
    400 naming ``param``, never a reply that ignores it. Compiled in a worker thread (a large
    schema, or the first one, which builds the vocabulary, takes a while; other streams go on)."""
    try:
        schema = read(body.model_dump(exclude_unset=False))
    except RequestError as e:  # (the message names the field: Anthropic's errors carry no param)
        raise ApiError(400, str(e), e.param, e.code) from None
    if schema is None:
        return None
    try:
        return await asyncio.to_thread(served.grammars.json_schema, schema)
    except GrammarError as e:
        raise ApiError(400, f"{param}: {e.message}", param) from None


def prompt_for(served: Served, conv: Conversation, constraint: GrammarConstraint | None = None) -> Prompt:
    """Render, force a tool call's start where asked, tokenize (the template writes any BOS).
    With a structured output (``constraint``) the reply is the JSON itself: a reasoning block the
    prompt opened is closed at once (as the templates render thinking off), tool calls are not
    parsed, and a forced tool call is refused (the two cannot both be the reply)."""
    if served.template is None:
        raise ApiError(400, f"model {served.name} has no chat template; use /v1/completions")
    try:
        text = served.template.render(conv.messages, tools=conv.tools or None, add_generation_prompt=True,
                                      **conv.template_kwargs)
    except SparkpackError as e:
        raise ApiError(400, f"the model's chat template rejected these messages: {e.problem}", "messages") from None
    reasoning = prompt_opens_reasoning(text)
    if constraint is not None:
        if conv.tools and conv.tool_choice not in ("auto", "none"):
            raise ApiError(400, "tool_choice forces a tool call, which cannot be combined with a structured output "
                                "format; use tool_choice 'auto' or drop the format", "tool_choice")
        prefix = closed_reasoning(served.syntax) if reasoning else ""
        parser = OutputParser(served.syntax, in_reasoning=reasoning, parse_tools=False, prefix=prefix)
        return Prompt(served.prompt_tokens.encode(text + prefix), parser, False, constraint)
    parse_tools = bool(conv.tools) and conv.tool_choice != "none"
    prefix = forced_prefix(served.syntax, conv.tool_choice, in_reasoning=reasoning) if parse_tools else ""
    parser = OutputParser(served.syntax, in_reasoning=reasoning, parse_tools=parse_tools, prefix=prefix,
                          tools=conv.tools)
    return Prompt(served.prompt_tokens.encode(text + prefix), parser, parse_tools)


def raw_prompt(served: Served, prompt: str | list[int]) -> Prompt:
    """/v1/completions: plain text (with the BOS the model asks for) or token ids, no template."""
    if isinstance(prompt, str):
        ids = served.tokenizer.encode(prompt, add_special=True)
    else:
        bad = [i for i in prompt if not 0 <= i < served.tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary (0..{served.tokenizer.vocab_size - 1})",
                           "prompt")
        ids = list(prompt)
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    return Prompt(ids, PlainText(), False)


def sampling(served: Served, body: Sampling) -> SamplingOptions:
    """The request's fields over the server's defaults."""
    given = body.model_dump(include=set(Sampling.model_fields), exclude_none=True)
    return dataclasses.replace(served.defaults, **given)


def stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def start(served: Served, prompt: Prompt, max_tokens: int | None, options: SamplingOptions, stops: list[str],
          body: Sampling, param: str = "messages") -> tuple[Job, EventStream]:
    """Queue the job: a prompt that leaves no room in the context is a 400; generation stops at
    ``max_tokens``, else the server's --max-tokens, and at the context's end (finish ``length``)."""
    n, ctx = len(prompt.ids), served.ctx
    if n >= ctx:
        raise context_exceeded(n, ctx, param)
    room = ctx - n
    max_tokens = max_tokens or served.max_tokens
    implicit = [s for s in IMPLICIT_STOPS.get(served.model.spec.arch, ()) if isinstance(prompt.parser, OutputParser)]
    stream = EventStream(asyncio.get_running_loop(), served.tokenizer, prompt.parser, stops, implicit)
    job = Job(prompt.ids, min(max_tokens, room) if max_tokens else room, options, stream,
              constraint=prompt.constraint, extra=dict(body.model_extra or {}))
    served.engine.submit(job)
    return job, stream


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict = field(default_factory=dict)

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class Collected:
    """A whole response: visible text, reasoning, tool calls and how it ended."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    finished: Finished | None = None
    _started: dict[int, ToolCall] = field(default_factory=dict)

    def add(self, ev) -> None:
        """Calls come from their ``ToolCallEnd`` only: a call cut off (max_tokens, a stop) is given
        back as text by the parser."""
        if isinstance(ev, TextDelta):
            self.text += ev.text
        elif isinstance(ev, ReasoningDelta):
            self.reasoning += ev.text
        elif isinstance(ev, ToolCallStart):
            self._started[ev.index] = ToolCall(ev.id, ev.name)
        elif isinstance(ev, ToolCallEnd):
            call = self._started.pop(ev.index)
            call.arguments = ev.arguments
            self.tool_calls.append(call)


async def collect(receive, job: Job, stream: EventStream) -> Collected:
    """Every event of the job; a client that disconnects meanwhile cancels it."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        job.cancel()

    watcher = asyncio.create_task(watch())
    out = Collected()
    try:
        async for item in stream.events():
            if isinstance(item, Finished):
                out.finished = item
            elif not isinstance(item, Started):
                for ev in item:
                    out.add(ev)
    finally:
        watcher.cancel()
        job.cancel()  # (nothing left to stop when it finished)
    return out


def failed(finished: Finished) -> ApiError | None:
    o = finished.outcome
    if o.finish == "error":
        return ApiError(500, f"generation failed: {o.error}")
    return None


async def complete(served: Served, route: str, request, job: Job, stream: EventStream) -> Collected:
    """A whole response (``collect``), counted in the metrics and noted for the log line; a
    failed generation raises its 500."""
    out = await collect(request.receive, job, stream)
    served.metrics.requests.labels(route, out.finished.outcome.finish).inc()
    record_of(request).outcome = out.finished.outcome
    err = failed(out.finished)
    if err:
        raise err
    return out


class StreamFormat(Protocol):
    """A dialect's SSE: what to send at each point of a job's stream (``relay`` drives it)."""

    def opening(self) -> list: ...

    def started(self, started: Started) -> list: ...

    def events(self, events: list) -> list: ...

    def finished(self, finished: Finished) -> list: ...

    def error(self, err: ApiError) -> list: ...


def streamed(served: Served, route: str, request, job: Job, stream: EventStream, fmt: StreamFormat,
             ping_event: Callable[[], Any] | None = None):
    """The SSE response of a job; its log line is written when the stream ends."""
    record = record_of(request)
    record.streamed = True
    return sse(relay(served, route, job, stream, fmt, record), ping_event)


async def relay(served: Served, route: str, job: Job, stream: EventStream, fmt: StreamFormat,
                record: RequestRecord) -> AsyncIterator:
    """The SSE items of a streamed job. A client that goes away (the generator is closed or
    cancelled) cancels the job; the outcome is counted in the metrics and logged either way."""
    outcome = "cancelled"
    try:
        for item in fmt.opening():
            yield item
        async for item in stream.events():
            if isinstance(item, Started):
                out = fmt.started(item)
            elif isinstance(item, Finished):
                outcome = item.outcome.finish
                record.outcome = item.outcome
                err = failed(item)
                if err:
                    record.error = err.message
                out = fmt.error(err) if err else fmt.finished(item)
            else:
                out = fmt.events(item)
            for x in out:
                yield x
    finally:
        job.cancel()
        served.metrics.requests.labels(route, outcome).inc()
        if record.outcome is None:  # the client went away first: what the engine counted so far
            known = stream.outcome
            record.outcome = (Outcome("cancelled", len(job.ids)) if known is None else
                              dataclasses.replace(known, finish="cancelled"))
        record.write()


def new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"
