"""Qwen3.5/3.6 and Qwen3-Coder::

    <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

As llama.cpp does for Qwen3-Coder, a call whose ``<tool_call>`` was left out is taken when it
opens with ``<function=NAME>`` of a tool in the request (``bare_opener``). A value ends only where
``</parameter>``, optional whitespace, then ``<parameter=NAME>`` or ``</function>`` +
``</tool_call>`` follow, NAME one of the tool's properties when its schema lists them."""
from __future__ import annotations

import re

from .base import TOOL_CLOSE, ToolParser, ToolSyntax
from .matching import FAIL, FULL, PARTIAL, WS, Name, match_any

FUNCTION_OPEN = "<function="
_VALUE_CANDIDATE = re.compile(r"[\n<]")


class XmlCall:
    """The states that read ``<function=NAME>`` and its parameters (the hermes syntax reads an XML
    body with them too)."""

    def __init__(self, stream):
        self.s = stream

    def body(self, final: bool) -> bool:
        s = self.s
        status, _, end, _ = match_any(s.buf, 0, ((WS, FUNCTION_OPEN),))
        if status == FULL:
            s.consume(end)
            s.state = self.function
            return True
        if status == PARTIAL:
            return False
        s.fail()
        return True

    def function(self, final: bool) -> bool:
        """``NAME>`` after ``<function=``, then the first parameter or the call's end."""
        s = self.s
        status, which, end, names = match_any(s.buf, 0, ((Name(">"), WS, "<parameter=", Name(">")),
                                                         (Name(">"), WS, "</function>", WS, TOOL_CLOSE)))
        if status == PARTIAL:
            return False
        if status == FAIL:
            s.fail()
            return True
        s.begin_call(end, names[0], names[1] if which == 0 else None, self.value_start)
        return True

    def value_start(self, final: bool) -> bool:
        """The template writes a newline after ``<parameter=KEY>``; it is not part of the value."""
        s = self.s
        if not s.buf:
            return False
        if s.buf[0] == "\n":
            s.consume(1)
        s.state = self.value
        return True

    def ends(self) -> tuple[tuple, ...]:
        known = self.s.known_params()
        return (("</parameter>", WS, "<parameter=", Name(">", known)),
                ("</parameter>", WS, "</function>", WS, TOOL_CLOSE),
                ("\n</parameter>", WS, "<parameter=", Name(">", known)),
                ("\n</parameter>", WS, "</function>", WS, TOOL_CLOSE))

    def value(self, final: bool) -> bool:
        return self.s.read_value(self.ends, _VALUE_CANDIDATE, {0, 2}, self.value_start)


class QwenXml(ToolParser):
    syntax = ToolSyntax.QWEN_XML
    archs = ("qwen35moe",)
    bare_opener = FUNCTION_OPEN

    def __init__(self, stream):
        super().__init__(stream)
        self.xml = XmlCall(stream)

    @staticmethod
    def teaches(template: str) -> bool:
        return FUNCTION_OPEN in template and "<parameter=" in template

    @staticmethod
    def call_start(name: str | None) -> str:
        return "<tool_call>\n<function=" + (f"{name}>\n" if name is not None else "")

    def body(self, final: bool) -> bool:
        return self.xml.body(final)

    def after_bare_opener(self, final: bool) -> bool:
        return self.xml.function(final)
