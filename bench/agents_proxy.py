"""A proxy between a real agent CLI and a real ``spark-run --serve`` that records every request
and scripts the replies, for ``bench/agents_check.py``.

A tiny random model writes random text, so a client's tool loop would never start. The server,
started through tests/hooked_server.py, teacher-forces a reply given in a body field no real
client sends; this proxy adds that field. The reply comes from a script named by a marker in the user's prompt
(``[agents-check:NAME]``), read in every dialect (Anthropic messages, OpenAI chat, Responses):
the script sees how many tool results followed the marked prompt and the tools offered, and
answers with the text the model is made to write (a tool call in the model's own syntax, or
plain text). Requests without a marked prompt (titles, summaries, subagents' housekeeping) get a
short default reply. Every request body and the usage of every answer are recorded, so that a
run shows what the real client sent and what it got back (cached tokens included).
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import uvicorn

from tests.hooked_server import FORCED  # (agents_check.py puts the repository on the path)

MARKER = re.compile(r"\[agents-check:([a-z0-9-]+)\]")
# Headers worth keeping in a recording (what a server may branch on); the key is never kept.
KEPT_HEADERS = ("anthropic-beta", "anthropic-version", "content-type", "user-agent", "x-app", "originator",
                "openai-beta", "accept", "content-encoding", "x-stainless-lang", "x-stainless-package-version",
                "x-stainless-retry-count", "x-stainless-timeout", "session_id", "x-codex-turn-metadata")
USAGE = {"cached": re.compile(rb'"(?:cache_read_input_tokens|cached_tokens|cache_n)"\s*:\s*(\d+)'),
         "prompt": re.compile(rb'"(?:prompt_tokens|input_tokens)"\s*:\s*(\d+)')}


@dataclass
class Turn:
    """Where a request stands in a scripted exchange: the marked prompt's script, how many tool
    results came back since it, their texts, and the tools offered (name -> JSON schema)."""

    script: str | None
    prompt: str  # the prompt's text
    results: int
    result_texts: list[str]
    tools: dict[str, dict]
    body: dict


@dataclass
class Exchange:
    """One request through the proxy and what came back."""

    n: int
    path: str
    headers: dict[str, str]
    body: object
    script: str | None = None
    forced: str | None = None
    status: int = 0
    cached: int = 0
    prompt: int = 0
    response: bytes = b""


@dataclass
class Recorder:
    """Every exchange, in order; ``save_to`` also writes each request as ``NNNN.json``."""

    save_to: Path | None = None
    exchanges: list[Exchange] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, ex: Exchange) -> None:
        with self.lock:
            self.exchanges.append(ex)

    def save(self, ex: Exchange) -> None:
        if self.save_to is None:
            return
        self.save_to.mkdir(parents=True, exist_ok=True)
        record = {"path": ex.path, "headers": ex.headers, "body": trimmed(ex.body)}
        (self.save_to / f"{ex.n:04d}.json").write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


TRIM_AT = 160  # characters: a recorded request's long texts (system prompts, tool docs) are cut here


def trimmed(value):
    """A recorded body with every long string cut (the shape kept whole: every field, message,
    block and tool), so that a test replays it on a tiny model in seconds."""
    if isinstance(value, str) and len(value) > TRIM_AT:
        return value[:TRIM_AT] + f" [trimmed from {len(value)} characters]"
    if isinstance(value, list):
        return [trimmed(v) for v in value]
    if isinstance(value, dict):
        return {k: trimmed(v) for k, v in value.items()}
    return value


def _text_of(content) -> str:
    """The text parts of a message's content in any dialect (tool results left out)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "\n".join(p.get("text", "") for p in content
                     if isinstance(p, dict) and p.get("type") in ("text", "input_text"))


def _result_text(item) -> str:
    content = item.get("content", item.get("output", ""))
    if isinstance(content, list):
        return "\n".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return content if isinstance(content, str) else json.dumps(content)


def turn_of(path: str, body: dict) -> Turn:
    """The latest user prompt (not a tool result) and the tool results after it, in the
    request's dialect: Anthropic ``tool_result`` blocks, OpenAI ``tool`` messages, Responses
    ``function_call_output`` items. Only a marker in that prompt counts: a later unmarked
    prompt (a summary request, a plain question) gets the default reply."""
    if path.endswith("/responses"):
        items = body.get("input") or []
        items = [{"role": "user", "content": items}] if isinstance(items, str) else items
        tools = {t.get("name"): t.get("parameters") or {} for t in body.get("tools") or [] if isinstance(t, dict)}
    else:
        items = body.get("messages") or []
        tools = {}
        for t in body.get("tools") or []:
            if isinstance(t, dict):
                fn = t.get("function", t)
                tools[fn.get("name")] = fn.get("parameters") or fn.get("input_schema") or {}
    results: list[str] = []
    script, prompt = None, ""
    for item in reversed(items):
        if not isinstance(item, dict):
            continue
        kind, role = item.get("type"), item.get("role")
        if kind in ("function_call_output", "custom_tool_call_output") or role == "tool":
            results.append(_result_text(item))
            continue
        if role != "user":
            continue
        blocks = item.get("content")
        tool_results = [b for b in blocks if isinstance(b, dict) and b.get("type") == "tool_result"] \
            if isinstance(blocks, list) else []
        if tool_results:
            results.extend(_result_text(b) for b in tool_results)
            continue
        text = _text_of(blocks)
        if not text.strip() or text.lstrip().startswith("<system-reminder>") and not MARKER.search(text):
            continue  # reminders the client adds after a prompt or a result
        if text.lstrip().startswith("<environment_context>") or text.lstrip().startswith("# AGENTS.md"):
            continue  # Codex's context items
        m = MARKER.findall(text)
        script, prompt = (m[-1] if m else None), text
        break
    return Turn(script, prompt, len(results), list(reversed(results)), tools, body)


def usage_of(response: bytes) -> tuple[int, int]:
    """(cached, prompt) tokens an answer reports, whichever dialect and stream form it takes."""
    cached = max((int(x) for x in USAGE["cached"].findall(response)), default=0)
    prompt = max((int(x) for x in USAGE["prompt"].findall(response)), default=0)
    return cached, prompt


def create_proxy(upstream: str, reply: Callable[[Turn, str], str | None], recorder: Recorder):
    """The proxy's ASGI app: each JSON POST gets ``reply(turn, path)``'s text forced (None: the
    request goes through untouched); everything is streamed back as the server sends it."""
    client = httpx.AsyncClient(base_url=upstream, timeout=httpx.Timeout(600.0))
    counter = iter(range(1, 1 << 30))

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        forward = {k: v for k, v in headers.items() if k not in ("host", "content-length", "accept-encoding")}
        ex = None
        if scope["method"] == "POST" and raw[:1] == b"{":
            body = json.loads(raw)
            ex = Exchange(next(counter), path, {k: v for k, v in headers.items() if k in KEPT_HEADERS}, body)
            turn = turn_of(path, body)
            ex.script = turn.script
            ex.forced = reply(turn, path)
            if ex.forced is not None:
                raw = json.dumps({**body, FORCED: ex.forced}).encode()
        query = scope.get("query_string", b"").decode()
        request = client.build_request(scope["method"], path + (f"?{query}" if query else ""), headers=forward,
                                       content=raw)
        response = await client.send(request, stream=True)
        try:
            await send({"type": "http.response.start", "status": response.status_code,
                        "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()
                                    if k.lower() not in ("content-length", "transfer-encoding")]})
            seen = b""
            async for chunk in response.aiter_raw():
                seen += chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await response.aclose()
        if ex is not None:
            ex.status, ex.response = response.status_code, seen
            ex.cached, ex.prompt = usage_of(seen)
            recorder.add(ex)
            recorder.save(ex)

    return app


class ProxyThread:
    """The proxy served from a thread of the calling process on a free port (``base``)."""

    def __init__(self, upstream: str, reply: Callable[[Turn, str], str | None], recorder: Recorder):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.base = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_proxy(upstream, reply, recorder), log_level="warning",
                                                    lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       daemon=True)
        self.thread.start()
        while not self.server.started:
            threading.Event().wait(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
