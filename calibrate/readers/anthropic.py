"""Anthropic Messages requests (``system`` + ``messages`` with content blocks), optionally logged
with their response as ``{"request": ..., "response": ...}`` or a body that carries ``response``."""
from __future__ import annotations

from typing import Any

from ..conversation import Conversation
from .base import FileContext, RecordError
from .messages import ConversationBuilder, openai_tools, text_of


def is_anthropic(record: dict[str, Any]) -> bool:
    """A ``messages`` record in Anthropic's spelling rather than OpenAI's (the two overlap for plain
    string turns, where either reader gives the same result)."""
    body = record["request"] if isinstance(record.get("request"), dict) else record
    if "system" in body or any(isinstance(t, dict) and "input_schema" in t for t in body.get("tools") or []):
        return True
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(isinstance(c, dict) and c.get("type") in
                                             ("tool_use", "tool_result", "thinking", "redacted_thinking")
                                             for c in content):
            return True
    return False


def read_record(record: dict[str, Any], ctx: FileContext, source: str) -> Conversation:
    body = record["request"] if isinstance(record.get("request"), dict) else record
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise RecordError("wrong types", "messages is not a list")
    b = ConversationBuilder(ctx)
    b.system(text_of(body.get("system"), ctx))
    for m in messages:
        if not isinstance(m, dict):
            raise RecordError("wrong types", "message is not an object")
        b.anthropic_message(m.get("role"), m.get("content"))
    response = record.get("response")
    if isinstance(response, dict) and response.get("role") == "assistant":
        b.anthropic_message("assistant", response.get("content"))
    if not b.messages:
        raise RecordError("no messages")
    return Conversation(messages=b.finish(), tools=openai_tools(body.get("tools")), source=source)
