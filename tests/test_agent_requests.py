"""Requests the real coding agents sent, replayed against the server in-process.

``tests/data/agent_requests/`` holds request bodies and the headers that matter, recorded from
the real clients (``bash bench/agents_check.sh --record DIR``: Claude Code, Codex CLI, OpenCode,
Aider at the versions agents_check.sh pins) with their long texts (system prompts, tool
documentation) cut to 160 characters and everything else as sent: every message,
block, tool schema, beta header and field. Each is replayed as sent on a tiny qwen35moe model,
whose real Qwen3.5 template is the strictest about roles, with the reply forced through the test
hooks (a tiny random model writes random text): the answer must be a 200 in the request's own
dialect and form (stream or not) carrying that reply. The requests of one conversation, replayed
in order, must reuse the prefix of the previous one.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.hooked_server import FORCED
from tests.marks import quick_first

DATA = Path(__file__).parent / "data" / "agent_requests"
RECORDED = sorted(p.stem for p in DATA.glob("*.json"))
ANSWER = "The recorded request was answered."
REPLY = f"<think>\nA short thought.\n</think>\n\n{ANSWER}"
CTX = 32768
DROPPED_HEADERS = {"content-length", "accept-encoding", "host"}


@pytest.fixture(scope="module")
def client(synth_model, tmp_path_factory):
    from fastapi.testclient import TestClient

    from sparkpack.runtime.options import open_model, run_options
    from sparkpack.runtime.server.app import create_app
    from sparkpack.runtime.server.serve import build_served
    from tests.hooked_server import ForcedReplies

    opts = run_options(synth_model("qwen35moe"), device="cpu", ctx=CTX, serve=True)
    app = create_app(opts.serve)
    replies = ForcedReplies(tmp_path_factory.mktemp("hooks"))
    app.state.served = build_served(open_model(opts), opts, hooks=replies.hooks)
    try:
        with TestClient(app) as c:
            yield c
    finally:
        app.state.served.engine.close()


def recorded(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text(encoding="utf-8"))


def replay(client, name: str, reply: str = REPLY):
    rec = recorded(name)
    headers = {k: v for k, v in rec["headers"].items() if k not in DROPPED_HEADERS}
    return client.post(rec["path"], json={**rec["body"], FORCED: reply}, headers=headers), rec


def sse_events(text: str) -> list[dict]:
    """The JSON data of every server-sent event (``[DONE]`` left out)."""
    out = []
    for line in text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def answer_of(path: str, streamed: bool, text: str) -> tuple[str, dict]:
    """(visible text, usage) of an answer in the route's dialect, whole or streamed."""
    if not streamed:
        body = json.loads(text)
        if path.endswith("/messages"):
            return "".join(b.get("text", "") for b in body["content"] if b["type"] == "text"), body["usage"]
        if path.endswith("/responses"):
            return "".join(c.get("text", "") for item in body["output"] if item["type"] == "message"
                           for c in item["content"]), body["usage"]
        return body["choices"][0]["message"]["content"] or "", body["usage"]
    events = sse_events(text)
    if path.endswith("/messages"):
        assert events[-1]["type"] == "message_stop"
        start = next(e for e in events if e["type"] == "message_start")  # (after any pings)
        usage = {**start["message"]["usage"], **next(e["usage"] for e in events if e["type"] == "message_delta")}
        return "".join(e["delta"]["text"] for e in events
                       if e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta"), usage
    if path.endswith("/responses"):
        assert events[-1]["type"] == "response.completed"
        return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta"), \
            events[-1]["response"]["usage"]
    assert text.rstrip().endswith("data: [DONE]")
    usage = next((e["usage"] for e in reversed(events) if e.get("usage")), {})
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices")), usage


def conversations() -> list[list[str]]:
    """The recorded requests grouped by conversation, in order: ``CLIENT-VERSION-N`` are one
    conversation's requests (N = 1, 2, ...), any other name (``...-title``) stands alone."""
    by: dict[str, list[str]] = {}
    for name in RECORDED:
        head, _, n = name.rpartition("-")
        by.setdefault(head if n.isdigit() else name, []).append(name)
    return [sorted(names, key=lambda s: int(s.rpartition("-")[2]) if s.rpartition("-")[2].isdigit() else 0)
            for names in by.values()]


def cached_of(usage: dict) -> int:
    return usage.get("cache_read_input_tokens") or (usage.get("prompt_tokens_details") or {}).get("cached_tokens") \
        or (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0


@pytest.mark.parametrize("names", quick_first(conversations()), ids=lambda names: names[0].rpartition("-")[0]
                         if len(names) > 1 else names[0])
def test_recorded_requests_get_their_answers_and_reuse_the_conversation(client, names):
    """Each request gets a 200 in its dialect carrying the forced reply; each one after the first
    (the client resending the conversation with a new turn) reuses what it shares with the one
    before."""
    for i, name in enumerate(names):
        r, rec = replay(client, name)
        assert r.status_code == 200, f"{name}: {r.status_code} {r.text[:400]}"
        text, usage = answer_of(rec["path"], bool(rec["body"].get("stream")), r.text)
        assert text.strip() == ANSWER, f"{name}: {text[:200]!r}"
        assert (usage.get("input_tokens") or usage.get("prompt_tokens")) > 0
        if i:
            assert cached_of(usage) > 0, f"{name}: nothing reused after {names[i - 1]}"
