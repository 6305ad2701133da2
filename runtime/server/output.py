"""Model text -> visible text, reasoning and tool calls, decided incrementally as tokens arrive.

This module is what every tool-call syntax shares: text and reasoning spans, finding where a call
opens, holding back text that may be a tag, and giving a call that never completes back as text;
reading a call's values and streaming them as JSON argument deltas is ``runtime.server.call_stream``'s
``CallReader``, which ``OutputParser`` extends. Each syntax's own structure (Qwen XML,
hermes JSON, Laguna) is one module of ``runtime.server.tool_parsers``, read through the
``CallStream`` methods (``call_stream``); a JSON body inside ``<tool_call>`` is accepted in every syntax
(the Qwen models fall back to it).

Values are raw text, so where a value ends is a choice. llama.cpp ends it at the first
``\\n</parameter>\\n`` (``</arg_value>`` for Laguna); ollama at the first ``</tool_call>``. Both cut
a file whose text contains those tags. Here a value ends only where the rest of the call's
structure follows (each syntax's ``ends``); when the tool's schema lists its properties, the next
parameter's name must be one of them, which is what llama.cpp's grammar would have forced. (A
value that quotes the whole closing sequence still ends there: while streaming nothing can tell
it from the real end.) As in llama.cpp a value is converted with the tool's JSON schema
(``tool_parsers.values.convert_value``).

Every decision depends on the text only, never on where it was split: text that may be the start
of a tag is held back until the next characters decide it, so any split gives the same events once
adjacent deltas of one kind are merged. Whitespace around the structure (after ``</think>``,
before ``<tool_call>``, between calls) is dropped, as ollama and the templates' own rendering do.
"""
from __future__ import annotations

import secrets
from collections.abc import Callable

from .output_events import Event, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd, ToolCallStart
from .tool_parsers import BY_SYNTAX, ToolSyntax, closed_reasoning, forced_prefix, tool_syntax_for
from .tool_parsers.base import TOOL_OPEN as _TOOL_OPEN
from .call_stream import Call, CallReader
from .tool_parsers.hermes_json import JsonBody
from .tool_parsers.matching import FAIL, FULL, Name, held, match
from .tool_parsers.values import convert_value


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Qwen3.5/3.6 (thinking on) end the generation prompt with ``<think>\\n`` and Laguna with
    ``<think>``: the model's first tokens are then reasoning. Only the very end counts, so a
    ``<think>`` quoted earlier in the conversation changes nothing."""
    return prompt_text.rstrip().endswith("<think>")


def _random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"


class OutputParser(CallReader):
    """Feed the model's text as it is decoded; get events back. One parser per generation.

    While a call is read, the syntax's parser (``tool_parsers``) drives it through ``buf``,
    ``state``, ``call`` and the call-reading methods of ``call_stream.CallReader``
    (``tool_parsers.base.CallStream``)."""

    def __init__(self, syntax: ToolSyntax, *, in_reasoning: bool, parse_tools: bool, prefix: str = "",
                 tools: list[dict] | None = None, new_id: Callable[[], str] = _random_call_id):
        """``tools`` (OpenAI function-tool form) give parameter types and the names a value may end
        before; ``new_id`` makes each call's id. ``prefix`` is parsed first, its events returned by
        the first ``feed``/``finish``."""
        super().__init__(tools, new_id)
        self.syntax = syntax
        self._tool = BY_SYNTAX[syntax](self)
        self._parse_tools = parse_tools
        opener = self._tool.bare_opener
        self._bare = (opener, frozenset(self._tools)) if opener and parse_tools and self._tools else None
        self._lead = True               # drop the whitespace that opens a text or reasoning span
        self._think_tag = True          # a leading <think> opens (or, in reasoning, repeats) the reasoning
        self.state: Callable[[bool], bool] = self._reasoning if in_reasoning else self._text
        if prefix:
            self.buf = prefix
            self._run(final=False)

    # public -----------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        self._run(final=False)
        return self._take_events()

    def finish(self) -> list[Event]:
        self._run(final=True)
        return self._take_events()

    # machinery --------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            if self.state(final):
                continue
            if final and self.call is not None:
                self._unterminated()
                continue
            return

    def _take_events(self) -> list[Event]:
        out, self._out = self._out, []
        merged: list[Event] = []
        for e in out:
            last = merged[-1] if merged else None
            if type(e) in (TextDelta, ReasoningDelta) and type(last) is type(e):
                merged[-1] = type(e)(last.text + e.text)
            elif type(e) is ToolCallDelta and type(last) is ToolCallDelta and last.index == e.index:
                merged[-1] = ToolCallDelta(e.index, last.arguments + e.arguments)
            else:
                merged.append(e)
        return merged

    def _strip_lead(self) -> bool:
        """Drop the span's leading whitespace; False while nothing else has arrived."""
        if self._lead:
            stripped = self.buf.lstrip()
            self.buf = stripped
            if not stripped:
                return False
            self._lead = False
        return True

    def _leading_think(self, final: bool, tags: tuple[str, ...]) -> str | None:
        """One of ``tags`` at the very start of the output: the tag if consumed, None while
        undecided, "" if the output starts otherwise."""
        if not self._think_tag:
            return ""
        for tag in tags:
            if self.buf.startswith(tag):
                self.buf = self.buf[len(tag):]
                self._think_tag, self._lead = False, True
                return tag
        if not final and any(tag.startswith(self.buf) for tag in tags):
            return None
        self._think_tag = False
        return ""

    # text and reasoning -----------------------------------------------------------------------

    def _text(self, final: bool) -> bool:
        if not self._strip_lead():
            return False
        # Qwen3 opens its reasoning itself; a prompt that closed the reasoning (Laguna's with
        # thinking off ends in </think>) may still see the model close it again: dropped, as ollama does.
        tag = self._leading_think(final, (_THINK_OPEN, _THINK_CLOSE))
        if tag is None:
            return False
        if tag:
            if tag == _THINK_OPEN:
                self.state = self._reasoning
            return True
        buf = self.buf
        if not self._parse_tools:
            self._emit(TextDelta(buf))
            self.buf = ""
            return False
        i = buf.find(_TOOL_OPEN)
        bare = self._bare_opener(buf, i if i >= 0 else len(buf))
        if bare is not None and bare[1]:
            self._open_call(buf[:bare[0]], back=self._text, kind=TextDelta, tag=self._bare[0])
            return True
        if bare is not None and not final:  # hold the opener and the whitespace before it
            cut = len(buf[:bare[0]].rstrip())
            self._emit(TextDelta(buf[:cut]))
            self.buf = buf[cut:]
            return False
        if i >= 0:
            self._open_call(buf[:i], back=self._text, kind=TextDelta)
            return True
        self._flush_before_tags(TextDelta, (_TOOL_OPEN, self._bare[0]) if self._bare else (_TOOL_OPEN,), final)
        return False

    def _bare_opener(self, buf: str, before: int) -> tuple[int, bool] | None:
        """Qwen3-Coder sometimes leaves out ``<tool_call>``; llama.cpp then takes ``<function=NAME>``
        of a tool in the request as the call's start (a syntax's ``bare_opener``). Returns where
        such an opener starts before ``before`` and whether it is complete (False: the name is
        still arriving)."""
        if not self._bare:
            return None
        opener, names = self._bare
        k = buf.find(opener)
        while 0 <= k < before:
            status, _, _ = match(buf, k, (opener, Name(">", names)))
            if status != FAIL:
                return k, status == FULL
            k = buf.find(opener, k + 1)
        return None

    def _reasoning(self, final: bool) -> bool:
        if not self._strip_lead():
            return False
        # some checkpoints repeat the <think> the prompt already opened (ollama strips it too)
        tag = self._leading_think(final, (_THINK_OPEN,))
        if tag is None:
            return False
        if tag:
            return True
        buf = self.buf
        tags = (_THINK_CLOSE, _TOOL_OPEN) if self._parse_tools else (_THINK_CLOSE,)
        found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
        if found:
            i, tag = min(found)
            if tag == _THINK_CLOSE:
                self._emit(ReasoningDelta(buf[:i].rstrip()))
                self.buf = buf[i + len(tag):]
                self.state, self._lead, self._think_tag = self._text, True, False
            else:  # Qwen3.5 and Laguna may open a call without closing the reasoning (llama.cpp, ollama)
                self._open_call(buf[:i], back=self._reasoning, kind=ReasoningDelta)
            return True
        self._flush_before_tags(ReasoningDelta, tags, final)
        return False

    def _flush_before_tags(self, kind: type, tags: tuple[str, ...], final: bool) -> None:
        """Emit the buffer but what may start a tag and the whitespace before it."""
        buf = self.buf
        if final:
            keep = 0
        else:
            cut = len(buf) - held(buf, tags)
            keep = len(buf) - len(buf[:cut].rstrip())
        self._emit(kind(buf[:len(buf) - keep]))
        self.buf = buf[len(buf) - keep:]

    def _open_call(self, before: str, back: Callable[[bool], bool], kind: type, tag: str = _TOOL_OPEN) -> None:
        body = before.rstrip()
        self._emit(kind(body))
        self.buf = self.buf[len(before) + len(tag):]
        self.call = Call(back=back, gap=before[len(body):], raw=[tag])
        self.state = self._call_body if tag == _TOOL_OPEN else self._tool.after_bare_opener

    def _call_body(self, final: bool) -> bool:
        """A JSON body (every syntax) or the syntax's own."""
        stripped = self.buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":
            self.consume(len(self.buf) - len(stripped))
            self.state = JsonBody(self).body
            return True
        self.state = self._tool.body
        return True

    # the end of a call, good or bad -----------------------------------------------------------

    def _unterminated(self) -> None:
        self.call.raw.append(self.buf)
        self.buf = ""
        self.fail()

    def after_call(self) -> None:
        self.state, self._lead, self._think_tag = self._text, True, False

    def fail(self) -> None:
        """Not a tool call after all: its text goes back where it came from; once a
        ToolCallStart is out (that call then never ends), it is visible text."""
        call = self.call
        text = call.gap + "".join(call.raw)
        self.call = None
        if call.index is None and call.back == self._reasoning:
            self._emit(ReasoningDelta(text))
            self.state = self._reasoning
        else:
            self._emit(TextDelta(text))
            self.state = self._text
        self._lead = self._think_tag = False


__all__ = ["Event", "OutputParser", "ReasoningDelta", "TextDelta", "ToolCallDelta", "ToolCallEnd", "ToolCallStart",
           "ToolSyntax", "closed_reasoning", "convert_value", "forced_prefix", "prompt_opens_reasoning",
           "tool_syntax_for"]
