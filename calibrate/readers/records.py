"""Which reader a single record (a JSON object or a dataset row) belongs to, and reading it.

Order of the checks, first match wins: ``messages`` (Anthropic when it uses Anthropic-only fields,
else OpenAI chat), a logged ``request``/``response`` pair, ``conversations`` (ShareGPT), then the
prompt / text columns of prompts.py. A record matching none is skipped as "unknown format".
"""
from __future__ import annotations

from typing import Any

from ..conversation import Conversation
from . import anthropic, openai_chat, prompts, sharegpt
from .base import WRONG_TYPES, FileContext, RecordError


def record_format(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    body = record["request"] if isinstance(record.get("request"), dict) else record
    if "messages" in body:
        return "anthropic" if anthropic.is_anthropic(record) else "openai"
    if "conversations" in record or "conversation" in record:
        return "sharegpt"
    if isinstance(record.get("prompt"), list):
        return "openai"
    if prompts.is_prompt_record(record):
        return "prompts"
    return None


READERS = {"openai": openai_chat.read_record, "anthropic": anthropic.read_record,
           "sharegpt": sharegpt.read_record, "prompts": prompts.read_record}


def read_record(record: Any, ctx: FileContext, loc: int | str, sep: str = ":") -> Conversation | None:
    """The conversation of one record, or None after counting (or, strict, raising) why not."""
    try:
        fmt = record_format(record)
        if fmt is None:
            ctx.skip("unknown format" if isinstance(record, dict) else "wrong types", loc,
                     "" if isinstance(record, dict) else f"record is {type(record).__name__}", sep)
            return None
        if fmt == "openai" and "messages" not in record and "request" not in record:
            record = {**record, "messages": record["prompt"]}  # a prompt column holding a message list
        return READERS[fmt](record, ctx, ctx.where(loc, sep))
    except RecordError as e:
        ctx.skip(e.reason, loc, e.detail, sep)
    except WRONG_TYPES as e:  # a field of a type the readers do not expect somewhere inside
        ctx.skip("wrong types", loc, f"{type(e).__name__}: {str(e)[:60]}", sep)
    return None
