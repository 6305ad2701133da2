"""Laguna: ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``.

A value ends only where ``</arg_value>``, optional whitespace, then ``<arg_key>NAME</arg_key><arg_value>``
or ``</tool_call>`` follow, NAME one of the tool's properties when its schema lists them."""
from __future__ import annotations

import re

from .base import TOOL_CLOSE, ToolParser, ToolSyntax
from .matching import FAIL, MAX_NAME, PARTIAL, WS, Name, match_any

_VALUE_CANDIDATE = re.compile(r"<")


class Laguna(ToolParser):
    syntax = ToolSyntax.LAGUNA
    archs = ("laguna",)
    close_reasoning = "</think>\n"

    @staticmethod
    def teaches(template: str) -> bool:
        return "<arg_key>" in template

    @staticmethod
    def call_start(name: str | None) -> str:
        return "<tool_call>" + (f"{name}\n" if name is not None else "")

    def body(self, final: bool) -> bool:
        s = self.s
        s.consume(len(s.buf) - len(s.buf.lstrip()))
        s.state = self.name
        return True

    def name(self, final: bool) -> bool:
        s = self.s
        buf = s.buf
        m = re.match(r"[^\s<>]*", buf)
        if m.end() == len(buf):
            if len(buf) > MAX_NAME:
                s.fail()
                return True
            return False
        name = m.group()
        status, which, end, names = match_any(buf, m.end(), ((WS, "<arg_key>", Name("</arg_key>"), WS, "<arg_value>"),
                                                             (WS, TOOL_CLOSE)))
        if status == PARTIAL:
            return False
        if status == FAIL or not name:
            s.fail()
            return True
        s.begin_call(end, name, names[0] if which == 0 else None, self.value)
        return True

    def ends(self) -> tuple[tuple, ...]:
        return (("</arg_value>", WS, "<arg_key>", Name("</arg_key>", self.s.known_params()), WS, "<arg_value>"),
                ("</arg_value>", WS, TOOL_CLOSE))

    def value(self, final: bool) -> bool:
        return self.s.read_value(self.ends, _VALUE_CANDIDATE, {0}, self.value)
