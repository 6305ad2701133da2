"""The one shape every corpus reader produces, whatever format the user's traffic came in.

Calibration replays traffic through the model to count which experts it routes to, so a record must
become exactly the tokens the model saw when serving. Chat records therefore keep the OpenAI
chat-completions message shape that Hugging Face chat templates (Qwen3 / Qwen3.5 style) render:

* ``{"role": "system" | "user", "content": str}``
* ``{"role": "assistant", "content": str, "reasoning_content": str?,
  "tool_calls": [{"id", "type": "function", "function": {"name", "arguments": JSON str}}]?}``
* ``{"role": "tool", "content": str, "tool_call_id": str, "name": str?}``

``tools`` is the OpenAI function-tool list (``{"type": "function", "function": {name, description,
parameters}}``) or None. Templates that iterate ``arguments|items`` (Qwen3-Coder / Qwen3.5 XML tool
calls) need the arguments as a mapping: the renderer parses the JSON string, readers keep the wire form.
Leading system (and developer) messages are merged into one; a system message later in a session
(Codex developer notes) is kept where it was: Qwen3 renders it, Qwen3.5 raises, so the renderer decides.

A conversation that ends on a user (or tool) message has no recorded answer (prompt lists, MT-Bench
``turns``): replay renders it with ``add_generation_prompt=True`` so the prompt ends where the model
would start answering; one that ends on an assistant message is replayed as is.

Plain documents (text, Markdown, source files, ``text`` columns) are ``kind="document"`` with raw
``text``: they are tokenised without any template, because nothing served wraps them in one.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Literal


@dataclass(frozen=True)
class Conversation:
    """One replayable unit: a chat (``messages`` + ``tools``) or a raw document (``text``)."""

    messages: list[dict[str, Any]]
    source: str
    tools: list[dict[str, Any]] | None = None
    kind: Literal["chat", "document"] = "chat"
    text: str | None = None
    id: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if not self.id:
            object.__setattr__(self, "id", content_id(self.kind, self.messages, self.tools, self.text))

    @property
    def needs_generation_prompt(self) -> bool:
        """True when the last turn awaits an answer, so replay should add the generation prompt."""
        return self.kind == "chat" and bool(self.messages) and self.messages[-1]["role"] != "assistant"


def content_id(kind: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               text: str | None) -> str:
    """A hash of the content, not of where it was found, so the same conversation keeps its id when
    a corpus is moved or re-exported, and duplicates across files can be recognised."""
    blob = json.dumps([kind, messages, tools, text], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def document(text: str, source: str) -> Conversation:
    return Conversation(messages=[], source=source, kind="document", text=text)
