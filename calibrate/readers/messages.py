"""Turn the message shapes of every vendor into the one chat-template shape (see conversation.py).

OpenAI chat, Anthropic Messages, Claude Code and Codex all describe the same things (text, thinking,
tool calls, tool results) with different field names and different splits into messages. One
builder applies the rules that chat templates rely on, so every reader gets them the same way:
leading system messages are merged into one (templates render only ``messages[0]`` as the system
prompt), consecutive assistant pieces (Claude Code writes one line per content block, Codex one
item per call) become one assistant turn, and tool results get their tool's name from the call.
"""
from __future__ import annotations

import json
from typing import Any

from .base import FileContext, RecordError, tag

IMAGE_PARTS = {"image", "image_url", "input_image", "image_file", "input_audio", "audio", "file",
               "input_file", "document"}


def as_arguments(value: Any) -> str:
    """Tool arguments as the JSON string the OpenAI wire format uses."""
    if value is None:
        return "{}"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def text_of(content: Any, ctx: FileContext) -> str:
    """Plain text of a content value: a string, or a list of text parts (images counted, dropped)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        content = [content]
    if not isinstance(content, list):
        raise RecordError("wrong types", f"content is {type(content).__name__}")
    texts = []
    for part in content:
        if isinstance(part, str):
            texts.append(part)
        elif not isinstance(part, dict):
            raise RecordError("wrong types", f"content part is {type(part).__name__}")
        elif tag(part.get("type")) in IMAGE_PARTS:
            ctx.image()
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif part.get("type") == "tool_result":  # a result nested in a result: keep its text
            texts.append(text_of(part.get("content"), ctx))
    return "\n".join(texts)


class ConversationBuilder:
    """Accumulates turns and applies the merging rules above; ``finish()`` returns the messages."""

    def __init__(self, ctx: FileContext):
        self.ctx = ctx
        self.messages: list[dict[str, Any]] = []
        self.tool_names: dict[str, str] = {}
        self._calls = 0

    def system(self, text: str) -> None:
        if not text:
            return
        if self.messages and all(m["role"] == "system" for m in self.messages):
            self.messages[0]["content"] += "\n\n" + text
        else:
            self.messages.append({"role": "system", "content": text})

    def user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    def _assistant(self, fresh: bool) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if last is None or last["role"] != "assistant" or fresh:
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        return last

    def assistant_text(self, text: str) -> None:
        if not text:
            return
        last = self.messages[-1] if self.messages else None
        # Text after tool calls belongs to the next step, which templates render as a new turn.
        msg = self._assistant(fresh=bool(last and last.get("tool_calls")))
        msg["content"] = f"{msg['content']}\n\n{text}" if msg["content"] else text

    def reasoning(self, text: str) -> None:
        if not text:
            return
        last = self.messages[-1] if self.messages else None
        fresh = bool(last and last["role"] == "assistant" and (last["content"] or last.get("tool_calls")))
        msg = self._assistant(fresh)
        prev = msg.get("reasoning_content")
        msg["reasoning_content"] = f"{prev}\n\n{text}" if prev else text

    def tool_call(self, name: Any, arguments: Any, call_id: Any = None) -> None:
        if not isinstance(name, str) or not name:
            raise RecordError("wrong types", "tool call without a name")
        self._calls += 1
        call_id = str(call_id) if call_id else f"call_{self._calls}"
        self.tool_names[call_id] = name
        msg = self._assistant(fresh=False)
        function = {"name": name, "arguments": as_arguments(arguments)}
        msg.setdefault("tool_calls", []).append({"id": call_id, "type": "function", "function": function})

    def tool_result(self, call_id: Any, content: str, name: str | None = None) -> None:
        msg: dict[str, Any] = {"role": "tool", "content": content, "tool_call_id": str(call_id or "")}
        name = name or self.tool_names.get(str(call_id))
        if name:
            msg["name"] = name
        self.messages.append(msg)

    def openai_message(self, m: Any) -> None:
        """One OpenAI chat message; Anthropic content blocks inside it are understood too."""
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise RecordError("wrong types", "message is not an object with a role")
        role = m["role"]
        content = m.get("content")
        if isinstance(content, list) and any(isinstance(b, dict) and tag(b.get("type")) in ANTHROPIC_BLOCKS
                                             for b in content):
            self.anthropic_message(role, content)
            return
        if role in ("system", "developer"):
            self.system(text_of(content, self.ctx))
        elif role == "user":
            self.user(text_of(content, self.ctx))
        elif role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise RecordError("wrong types", "tool_calls is not a list")
            msg: dict[str, Any] = {"role": "assistant", "content": text_of(content, self.ctx)}
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if isinstance(reasoning, str) and reasoning:
                msg["reasoning_content"] = reasoning
            self.messages.append(msg)
            for call in calls:
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict):
                    raise RecordError("wrong types", "tool call without a function object")
                self.tool_call(fn.get("name"), fn.get("arguments"), call.get("id"))
            if isinstance(m.get("function_call"), dict):  # the pre-tools OpenAI spelling
                fc = m["function_call"]
                self.tool_call(fc.get("name"), fc.get("arguments"))
        elif role in ("tool", "function"):
            call_id = m.get("tool_call_id") or ""
            if not call_id and role == "function":
                call_id = next((i for i, n in reversed(self.tool_names.items()) if n == m.get("name")), "")
            self.tool_result(call_id, text_of(content, self.ctx), m.get("name"))
        else:
            raise RecordError("unknown role", role)

    def anthropic_message(self, role: str, content: Any) -> None:
        """One Anthropic Messages turn: a string or a list of text/thinking/tool_use/tool_result blocks."""
        if isinstance(content, str) or content is None:
            content = [{"type": "text", "text": content or ""}]
        if not isinstance(content, list):
            raise RecordError("wrong types", f"content is {type(content).__name__}")
        if role in ("system", "developer"):
            self.system(text_of(content, self.ctx))
            return
        if role not in ("user", "assistant"):
            raise RecordError("unknown role", str(role))
        user_text: list[str] = []
        for block in content:
            if not isinstance(block, dict):
                raise RecordError("wrong types", f"content block is {type(block).__name__}")
            kind = tag(block.get("type"))
            if kind == "text":
                (user_text.append if role == "user" else self.assistant_text)(str(block.get("text", "")))
            elif kind == "thinking":
                self.reasoning(str(block.get("thinking", "")))
            elif kind == "redacted_thinking":
                continue  # encrypted: the tokens the model saw are not recoverable
            elif kind in ("tool_use", "server_tool_use"):
                self.tool_call(block.get("name"), block.get("input"), block.get("id"))
            elif kind == "tool_result":
                # Results come first in a user turn; text typed beside them follows as a user message.
                self.tool_result(block.get("tool_use_id"), text_of(block.get("content"), self.ctx))
            elif kind in IMAGE_PARTS:
                self.ctx.image()
        if role == "user" and (user_text or not content):
            self.user("\n".join(user_text))

    def finish(self) -> list[dict[str, Any]]:
        return self.messages


ANTHROPIC_BLOCKS = {"tool_use", "tool_result", "thinking", "redacted_thinking", "server_tool_use"}


def openai_tools(tools: Any) -> list[dict[str, Any]] | None:
    """Tool definitions in the OpenAI function-tool schema, whichever vendor's schema they came in."""
    if tools is None or tools == []:
        return None
    if isinstance(tools, str):  # ShareGPT / LLaMA-Factory store them as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise RecordError("wrong types", f"tools is not valid JSON ({e.msg})") from None
    if not isinstance(tools, list):
        raise RecordError("wrong types", "tools is not a list")
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise RecordError("wrong types", "tool is not an object")
        if isinstance(t.get("function"), dict):
            out.append({"type": "function", "function": t["function"]})
        elif "name" in t:  # Anthropic (input_schema), Responses API or bare function (parameters)
            fn = {"name": t["name"]}
            if t.get("description"):
                fn["description"] = t["description"]
            params = t.get("parameters", t.get("input_schema"))
            if params is not None:
                fn["parameters"] = params
            out.append({"type": "function", "function": fn})
        else:
            raise RecordError("wrong types", "tool without a name")
    return out or None
