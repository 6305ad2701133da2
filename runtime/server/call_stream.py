"""The tool call being read, and the half of the streaming machinery a syntax's parser drives it
through (``tool_parsers.base.CallStream``): consuming the call's text, starting it, reading each parameter's
value up to where the call's structure resumes, streaming values as JSON argument deltas, and
ending it.

Why apart from ``runtime.server.output`` (and outside ``tool_parsers``, which see it only as a
``CallStream``): every syntax reads its values through these steps
(a value ends only where the rest of the call's structure follows, and is converted with the
tool's schema), while finding where a call opens among text and reasoning is the output
parser's job; ``OutputParser`` subclasses ``CallReader`` and supplies what a call returns to
(``after_call``) and how a broken call goes back (``fail``).
"""
from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from .output_events import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .tool_parsers.base import State
from .tool_parsers.matching import FAIL, FULL, match_any
from .tool_parsers.values import ANY, STRING, convert_value, json_text, tool_params


@dataclass
class Call:
    """The tool call being read: raw text kept so that a call that never completes becomes text."""
    back: State                          # the state the call interrupted (text or reasoning)
    gap: str                             # whitespace dropped before <tool_call>, given back on failure
    raw: list[str]                       # the call's text so far, from its opening tag
    index: int | None = None             # set when ToolCallStart is out
    name: str = ""
    args: dict = field(default_factory=dict)
    key: str = ""                        # the parameter being read
    types: frozenset[str] = ANY
    streams: bool = False                # this parameter's text goes out as it arrives
    value: list[str] = field(default_factory=list)


class CallReader(ABC):
    """``buf``: the text not yet consumed; ``state``: the next state to run; ``call``: the call
    being read (None between calls). ``tools`` (OpenAI function-tool form) give parameter types
    and the names a value may end before; ``new_id`` makes each call's id."""

    def __init__(self, tools: list[dict] | None, new_id: Callable[[], str]):
        self._tools = tool_params(tools)
        self._new_id = new_id
        self._calls = 0
        self._out: list[Event] = []
        self.buf = ""
        self.call: Call | None = None
        self.state: State

    def _emit(self, event: Event) -> None:
        if isinstance(event, (TextDelta, ReasoningDelta)) and not event.text:
            return
        if isinstance(event, ToolCallDelta) and not event.arguments:
            return
        self._out.append(event)

    @abstractmethod
    def after_call(self) -> None:
        """A call ended: the state that reads what follows it."""

    @abstractmethod
    def fail(self) -> None:
        """Not a tool call after all: its text goes back where it came from."""

    def consume(self, n: int) -> str:
        taken, self.buf = self.buf[:n], self.buf[n:]
        if self.call is not None:
            self.call.raw.append(taken)
        return taken

    def start_call(self) -> None:
        call = self.call
        if call.index is None:
            call.index = self._calls
            self._calls += 1
            self._emit(ToolCallStart(call.index, self._new_id(), call.name))

    def end_call(self) -> None:
        call = self.call
        self.start_call()
        self._emit(ToolCallEnd(call.index, call.args))
        self.call = None
        self.after_call()

    def emit_arguments(self, text: str) -> None:
        self._emit(ToolCallDelta(self.call.index, text))

    def known_params(self) -> frozenset[str] | None:
        params = self._tools.get(self.call.name)
        return frozenset(params) if params else None

    def begin_value(self, key: str) -> None:
        call = self.call
        params = self._tools.get(call.name)
        call.key = key
        call.types = params.get(key, STRING) if params else STRING
        call.streams = call.types == STRING
        call.value = []
        if call.streams:
            self.emit_arguments(("{" if not call.args else ", ") + json_text(key) + ': "')

    def begin_call(self, end: int, name: str, first_key: str | None, then: State) -> None:
        """The call's name (and its first parameter's key, if any) was read up to ``end``: the call
        starts, then that parameter's value is read in ``then``, or the call ends (no parameters)."""
        self.consume(end)
        self.call.name = name
        self.start_call()
        if first_key is None:
            self.end_tagged_call()
        else:
            self.begin_value(first_key)
            self.state = then

    def _value_text(self, text: str) -> None:
        call = self.call
        call.value.append(text)
        if call.streams:
            self.emit_arguments(json_text(text)[1:-1])

    def _end_value(self) -> None:
        call = self.call
        raw = "".join(call.value)
        if call.streams:
            value, piece = raw, '"'
        else:
            value = convert_value(raw, call.types)
            piece = ("{" if not call.args else ", ") + json_text(call.key) + ": " + json_text(value)
        call.args[call.key] = value  # a repeated key: the last value wins, as json.loads does
        self.emit_arguments(piece)

    def read_value(self, ends: Callable[[], tuple[tuple, ...]], candidates: re.Pattern, next_key: set[int],
                   then: State) -> bool:
        """Move the value's text out of the buffer up to where the call's structure may resume
        (``ends``, tried where ``candidates`` match); once it does, start the next parameter (the
        alternatives in ``next_key``, continuing in ``then``) or end the call."""
        buf = self.buf
        alts = ends()
        for m in candidates.finditer(buf):
            status, which, end, names = match_any(buf, m.start(), alts)
            if status == FAIL:
                continue
            self._value_text(self.consume(m.start()))
            if status != FULL:
                return False
            self.consume(end - m.start())
            self._end_value()
            if which in next_key:
                self.begin_value(names[0])
                self.state = then
            else:
                self.end_tagged_call()
            return True
        self._value_text(self.consume(len(buf)))
        return False

    def end_tagged_call(self) -> None:
        self.emit_arguments("}" if self.call.args else "{}")
        self.end_call()
