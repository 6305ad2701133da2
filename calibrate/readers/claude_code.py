"""Claude Code session files (``~/.claude/projects/<project>/<session>.jsonl``): one event a line.

``user`` / ``assistant`` events carry an Anthropic ``message``; everything else (summaries,
file-history snapshots, system notices, progress) never reached the model and is skipped silently.
Claude Code writes one line per content block of an assistant reply; the builder joins them into
one turn. Sidechain events (sub-agents) are a different conversation with another context, so they
are left out of the session's conversation and counted. One file is one conversation.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ..conversation import Conversation
from .base import WRONG_TYPES, FileContext, RecordError, iter_jsonl
from .messages import ConversationBuilder

MESSAGE_EVENTS = ("user", "assistant")


def looks_like(records: list[dict[str, Any]]) -> bool:
    """Claude Code events carry a session id / uuid beside the ``type``; bare chat records do not."""
    return any(r.get("type") in MESSAGE_EVENTS and isinstance(r.get("message"), dict)
               and ("sessionId" in r or "uuid" in r) for r in records) or \
        any(r.get("type") in ("summary", "file-history-snapshot") for r in records)


def read_file(ctx: FileContext) -> Iterator[Conversation]:
    b = ConversationBuilder(ctx)
    for lineno, event in iter_jsonl(ctx):
        if not isinstance(event, dict):
            ctx.skip("wrong types", lineno, "event is not an object")
            continue
        if event.get("type") not in MESSAGE_EVENTS:
            continue
        if event.get("isSidechain"):
            ctx.note("sidechain event")
            continue
        msg = event.get("message")
        if not isinstance(msg, dict):
            ctx.skip("wrong types", lineno, "message is not an object")
            continue
        try:
            b.anthropic_message(msg.get("role", event["type"]), msg.get("content"))
        except RecordError as e:
            ctx.skip(e.reason, lineno, e.detail)
        except WRONG_TYPES as e:
            ctx.skip("wrong types", lineno, f"{type(e).__name__}: {str(e)[:60]}")
    if b.messages:
        yield Conversation(messages=b.finish(), source=ctx.where())
    else:
        ctx.skip("no messages", None)
