"""OpenAI chat-completions requests and responses (JSON or JSONL, one request per record).

Accepted record shapes: a request body (``messages`` + optional ``tools``); a request body that also
carries the response (``choices``); and a logged pair ``{"request": {...}, "response": {...}}``. The
response's ``choices[0].message`` is appended, because the served answer is traffic too.
"""
from __future__ import annotations

import json
from typing import Any

from ..conversation import Conversation
from .base import FileContext, RecordError
from .messages import ConversationBuilder, openai_tools


def split_request(record: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """(request body, response or None) for the record shapes above."""
    if isinstance(record.get("request"), dict):
        return record["request"], record.get("response")
    return record, (record if "choices" in record else record.get("response"))


def response_message(response: Any) -> dict[str, Any] | None:
    if not isinstance(response, dict):
        return None
    choices = response.get("choices")
    if isinstance(choices, list) and choices and isinstance(choices[0], dict):
        msg = choices[0].get("message")
        return msg if isinstance(msg, dict) else None
    return None


def read_record(record: dict[str, Any], ctx: FileContext, source: str) -> Conversation:
    request, response = split_request(record)
    messages = request.get("messages")
    if isinstance(messages, str):  # some datasets keep the list as a JSON string
        try:
            messages = json.loads(messages)
        except json.JSONDecodeError:
            pass
    if not isinstance(messages, list):
        raise RecordError("wrong types", "messages is not a list")
    b = ConversationBuilder(ctx)
    for m in messages:
        b.openai_message(m)
    answer = response_message(response)
    if answer is not None:
        b.openai_message({"role": "assistant", **answer})
    if not b.messages:
        raise RecordError("no messages")
    return Conversation(messages=b.finish(), tools=openai_tools(request.get("tools")), source=source)
