"""What one tool-call syntax supplies, and what it reads a call's body through.

The streaming machinery (``runtime.server.output.OutputParser``) finds where a call opens, holds
back text that may be a tag, streams values and turns a call that never completes back into text;
a syntax's parser (one module each in this package) reads the call's body from there on, as
states the machinery runs (a state returns True when it moved on, False while it waits for more
text)."""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
import re
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

State = Callable[[bool], bool]  # (final) -> whether it moved on


class ToolSyntax(enum.Enum):
    QWEN_XML = "qwen_xml"
    HERMES_JSON = "hermes_json"
    LAGUNA = "laguna"


class CallStream(Protocol):
    """The machinery as a parser sees it while reading one call."""

    buf: str              # the text not yet consumed
    state: State          # the next state to run
    call: Any             # the call being read (``runtime.server.call_stream.Call``): name, args

    def consume(self, n: int) -> str: ...
    def start_call(self) -> None: ...
    def fail(self) -> None: ...
    def begin_value(self, key: str) -> None: ...
    def begin_call(self, end: int, name: str, first_key: str | None, then: State) -> None: ...
    def read_value(self, ends: Callable[[], tuple[tuple, ...]], candidates: re.Pattern, next_key: set[int],
                   then: State) -> bool: ...
    def end_tagged_call(self) -> None: ...
    def end_call(self) -> None: ...
    def emit_arguments(self, text: str) -> None: ...
    def known_params(self) -> frozenset[str] | None: ...


class ToolParser(ABC):
    """One syntax: how its chat template shows it, how a forced call starts, what closes an empty
    reasoning block, and the states that read a call body that is not JSON (a JSON body, which
    the Qwen models fall back to in every syntax, is ``hermes_json.JsonBody``'s)."""

    syntax: ClassVar[ToolSyntax]
    archs: ClassVar[tuple[str, ...]] = ()        # the arch's default when its template shows no syntax
    close_reasoning: ClassVar[str] = "\n</think>\n\n"
    bare_opener: ClassVar[str | None] = None     # a call opener the model may write without <tool_call>

    def __init__(self, stream: CallStream):
        self.s = stream

    @staticmethod
    @abstractmethod
    def teaches(template: str) -> bool:
        """Whether a chat template teaches this syntax."""

    @staticmethod
    @abstractmethod
    def call_start(name: str | None) -> str:
        """The start of a call of tool ``name`` (None: the model picks the tool)."""

    @abstractmethod
    def body(self, final: bool) -> bool:
        """The state after ``<tool_call>`` when the body does not open with ``{``."""

    def after_bare_opener(self, final: bool) -> bool:
        """The state after ``bare_opener`` (only a syntax that sets one is ever in it)."""
        raise TypeError(f"{type(self).__name__} has no bare call opener")
