"""Codex CLI session rollouts (``~/.codex/sessions/YYYY/MM/DD/rollout-*.jsonl``): one record a line.

Current files wrap each record as ``{"timestamp", "type", "payload"}``; only ``response_item``
payloads are what the model saw (``session_meta``, ``turn_context``, ``event_msg`` duplicate or
describe them). Older files put the response items on the lines directly. Payload types:
``message`` (role user / assistant / developer, content parts ``input_text`` / ``output_text``),
``function_call`` (name, arguments JSON string, call_id), ``function_call_output`` (call_id, output:
a string, or an object with ``content``), ``custom_tool_call`` / ``custom_tool_call_output``
(free-form tools such as apply_patch), ``local_shell_call`` and ``reasoning`` (readable ``summary``
or ``content`` text; ``encrypted_content`` cannot be replayed and is dropped). One file is one
conversation; ``session_meta.payload.instructions``, when recorded, is its system prompt.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from ..conversation import Conversation
from .base import WRONG_TYPES, FileContext, RecordError, iter_jsonl, tag
from .messages import ConversationBuilder, text_of

ENVELOPES = {"session_meta", "response_item", "turn_context", "event_msg", "compacted"}
ITEMS = {"message", "function_call", "function_call_output", "reasoning", "custom_tool_call",
         "custom_tool_call_output", "local_shell_call", "web_search_call"}


def looks_like(records: list[dict[str, Any]]) -> bool:
    return any(tag(r.get("type")) in ENVELOPES and isinstance(r.get("payload"), dict) for r in records) or \
        any(tag(r.get("type")) in ITEMS - {"message"} and ("call_id" in r or "summary" in r) for r in records) or \
        any(r.get("record_type") == "state" for r in records)


def output_text(output: Any, ctx: FileContext) -> str:
    if isinstance(output, dict):
        return text_of(output.get("content", output.get("output", "")), ctx)
    return text_of(output, ctx)


def add_item(b: ConversationBuilder, item: dict[str, Any], ctx: FileContext) -> None:
    kind = item.get("type")
    if kind == "message":
        role = item.get("role")
        text = text_of(item.get("content"), ctx)
        if role in ("system", "developer"):
            b.system(text)
        elif role == "user":
            b.user(text)
        elif role == "assistant":
            b.assistant_text(text)
        else:
            raise RecordError("unknown role", str(role))
    elif kind == "reasoning":
        parts = item.get("content") or item.get("summary") or []
        b.reasoning(text_of(parts, ctx))
    elif kind == "function_call":
        b.tool_call(item.get("name"), item.get("arguments"), item.get("call_id"))
    elif kind == "custom_tool_call":
        b.tool_call(item.get("name"), json.dumps({"input": item.get("input", "")}), item.get("call_id"))
    elif kind == "local_shell_call":
        b.tool_call("shell", item.get("action"), item.get("call_id"))
    elif kind in ("function_call_output", "custom_tool_call_output"):
        b.tool_result(item.get("call_id"), output_text(item.get("output"), ctx))
    # web_search_call and other hosted items carry no replayable text


def read_file(ctx: FileContext) -> Iterator[Conversation]:
    b = ConversationBuilder(ctx)
    for lineno, rec in iter_jsonl(ctx):
        if not isinstance(rec, dict):
            ctx.skip("wrong types", lineno, "record is not an object")
            continue
        if rec.get("type") == "session_meta" and isinstance(rec.get("payload"), dict):
            instructions = rec["payload"].get("instructions")
            if isinstance(instructions, str):
                b.system(instructions)
            continue
        if "type" not in rec and isinstance(rec.get("instructions"), str):  # older files' first line
            b.system(rec["instructions"])
            continue
        if rec.get("type") == "response_item":
            item = rec.get("payload")
        elif tag(rec.get("type")) in ITEMS:
            item = rec
        else:
            continue
        if not isinstance(item, dict):
            ctx.skip("wrong types", lineno, "payload is not an object")
            continue
        try:
            add_item(b, item, ctx)
        except RecordError as e:
            ctx.skip(e.reason, lineno, e.detail)
        except WRONG_TYPES as e:
            ctx.skip("wrong types", lineno, f"{type(e).__name__}: {str(e)[:60]}")
    if b.messages:
        yield Conversation(messages=b.finish(), source=ctx.where())
    else:
        ctx.skip("no messages", None)
