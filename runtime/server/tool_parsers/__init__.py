"""The tool-call syntaxes, one module each: which one a model uses, and how a forced call starts.

A syntax's module holds everything that is its own (how its template shows it, how a call starts
and ends, how values end); ``runtime.server.output`` holds what all share (streaming, holding back
possible tags, turning a broken call back into text). Add a syntax: a ``ToolParser`` subclass in
its own module, a ``ToolSyntax`` member, an entry in ``PARSERS``, and its cases in
``tests/server_outputs.py`` (the streaming tests run every registered syntax)."""
from __future__ import annotations

from .base import CallStream, ToolParser, ToolSyntax
from .hermes_json import HermesJson
from .laguna import Laguna
from .qwen_xml import QwenXml

# The order the template check tries them in: the most specific marks first (every template
# that teaches a syntax shows ``<tool_call>``, the hermes mark).
PARSERS: tuple[type[ToolParser], ...] = (Laguna, QwenXml, HermesJson)
BY_SYNTAX: dict[ToolSyntax, type[ToolParser]] = {p.syntax: p for p in PARSERS}


def tool_syntax_for(arch: str, chat_template: str) -> ToolSyntax:
    """The template decides (a Qwen3-Coder GGUF is arch ``qwen3moe`` but teaches XML calls); the
    arch only where the template shows no tool-call format."""
    template = chat_template or ""
    for parser in PARSERS:
        if parser.teaches(template):
            return parser.syntax
    return next((p.syntax for p in PARSERS if arch in p.archs), ToolSyntax.HERMES_JSON)


def closed_reasoning(syntax: ToolSyntax) -> str:
    """What closes a reasoning block the prompt opened, as the template renders an empty one."""
    return BY_SYNTAX[syntax].close_reasoning


def forced_prefix(syntax: ToolSyntax, tool_choice: str | dict, *, in_reasoning: bool = False) -> str:
    """The start of a tool call, written into the prompt after the generation prompt, so that
    ``required`` gets a call and a named choice gets a call of that tool. ``in_reasoning``: the
    prompt opened ``<think>``; the prefix closes it first (as the templates render an empty one)."""
    if tool_choice in ("auto", "none"):
        return ""
    if tool_choice == "required":
        name = None
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("name"), str):
        name = tool_choice["name"]
    else:
        raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or {{'name': ...}}, got {tool_choice!r}")
    return (closed_reasoning(syntax) if in_reasoning else "") + BY_SYNTAX[syntax].call_start(name)


__all__ = ["BY_SYNTAX", "PARSERS", "CallStream", "ToolParser", "ToolSyntax", "closed_reasoning", "forced_prefix",
           "tool_syntax_for"]
