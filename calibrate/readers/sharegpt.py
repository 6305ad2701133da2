"""ShareGPT-style records: ``conversations`` of ``{"from", "value"}`` turns (FastChat, LLaMA-Factory,
glaive function-calling sets). Some datasets use the same key with ``role``/``content`` turns."""
from __future__ import annotations

import json
from typing import Any

from ..conversation import Conversation
from .base import FileContext, RecordError
from .messages import ConversationBuilder, openai_tools

ROLE_OF = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
           "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
           "system": "system", "function_call": "function_call", "observation": "tool", "tool": "tool",
           "function_response": "tool", "function": "tool"}


def turns_of(record: dict[str, Any]) -> Any:
    return record.get("conversations", record.get("conversation"))


def read_record(record: dict[str, Any], ctx: FileContext, source: str) -> Conversation:
    turns = turns_of(record)
    if not isinstance(turns, list):
        raise RecordError("wrong types", "conversations is not a list")
    b = ConversationBuilder(ctx)
    if isinstance(record.get("system"), str):
        b.system(record["system"])
    for t in turns:
        if not isinstance(t, dict):
            raise RecordError("wrong types", "turn is not an object")
        if "from" not in t:
            b.openai_message(t)
            continue
        role = ROLE_OF.get(str(t["from"]).lower())
        value = t.get("value")
        if role is None:
            raise RecordError("unknown role", str(t["from"]))
        if not isinstance(value, str):
            raise RecordError("wrong types", "turn value is not a string")
        if role == "system":
            b.system(value)
        elif role == "user":
            b.user(value)
        elif role == "assistant":
            b.assistant_text(value)
        elif role == "function_call":  # value is {"name", "arguments"} as JSON
            try:
                call = json.loads(value)
            except json.JSONDecodeError:
                raise RecordError("wrong types", "function_call value is not JSON") from None
            if not isinstance(call, dict):
                raise RecordError("wrong types", "function_call value is not an object")
            b.tool_call(call.get("name"), call.get("arguments", call.get("parameters")))
        else:
            last_call = next(reversed(b.tool_names), None)
            b.tool_result(last_call, value)
    if not b.messages:
        raise RecordError("no messages")
    return Conversation(messages=b.finish(), tools=openai_tools(record.get("tools")), source=source)
