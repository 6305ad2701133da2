"""Prompt lists and prompt columns: records whose text is a prompt (and maybe its answer), not a chat.

Column heuristics, first match wins (documented in corpora/README.md):

* ``turns``: a list of strings, each a user turn (MT-Bench); no answers are recorded, so the
  conversation is user turns only and replay renders it with ``add_generation_prompt=True``.
* a prompt column: ``prompt``, ``instruction``, ``question``, ``problem_statement`` (SWE-bench),
  ``query``, ``input``; Alpaca's ``instruction`` + ``input`` are joined. A ``system`` string becomes
  the system message; an answer column (``response``, ``output``, ``completion``, ``answer``)
  becomes the assistant turn. SWE-bench's ``hints_text`` is left out: it is the maintainers' issue
  discussion, which the standard SWE-bench setup does not show the model.
* ``text`` / ``content`` alone: raw text (``kind="document"``), the Hugging Face convention for
  pre-training style datasets, which nothing serves inside a chat template.
"""
from __future__ import annotations

from typing import Any

from ..conversation import Conversation, document
from .base import FileContext, RecordError
from .messages import ConversationBuilder

PROMPT_KEYS = ("prompt", "instruction", "question", "problem_statement", "query", "input")
ANSWER_KEYS = ("response", "output", "completion", "answer")
TEXT_KEYS = ("text", "content")


def is_prompt_record(record: dict[str, Any]) -> bool:
    return "turns" in record or any(isinstance(record.get(k), str) for k in PROMPT_KEYS + TEXT_KEYS)


def read_record(record: dict[str, Any], ctx: FileContext, source: str) -> Conversation:
    b = ConversationBuilder(ctx)
    if isinstance(record.get("system"), str):
        b.system(record["system"])
    if "turns" in record:
        turns = record["turns"]
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise RecordError("wrong types", "turns is not a list of strings")
        for t in turns:
            b.user(t)
    else:
        key = next((k for k in PROMPT_KEYS if isinstance(record.get(k), str)), None)
        if key is None:
            text = next(record[k] for k in TEXT_KEYS if isinstance(record.get(k), str))
            if not text.strip():
                raise RecordError("no messages", "empty text")
            return document(text, source)
        prompt = record[key]
        if key == "instruction" and isinstance(record.get("input"), str) and record["input"].strip():
            prompt = f"{prompt}\n\n{record['input']}"
        b.user(prompt)
        answer = next((record[k] for k in ANSWER_KEYS if isinstance(record.get(k), str) and k != key), None)
        if answer:
            b.assistant_text(answer)
    if not any(m["role"] == "user" and m["content"].strip() for m in b.messages):
        raise RecordError("no messages", "empty prompt")
    return Conversation(messages=b.finish(), source=source)
