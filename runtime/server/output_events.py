"""What the output parser (``runtime.server.output``) gives back as the model's text arrives: visible
text, reasoning, and tool calls as a start, argument deltas and an end. Every API dialect turns
these into its own stream (``openai_api``, ``anthropic_api``, ``responses_api``).

Why a module of its own: the dialects and the tool-call machinery
(``call_stream``) read the events without the parser's states.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallDelta:
    """The next piece of the call's arguments as JSON text; the pieces of one call concatenate to
    JSON that parses to its ``ToolCallEnd.arguments``."""
    index: int
    arguments: str


@dataclass(frozen=True)
class ToolCallEnd:
    index: int
    arguments: dict


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallDelta | ToolCallEnd
