"""Qwen3 (hermes style): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``.

The JSON body (``JsonBody``) is accepted in every syntax (the Qwen models fall back to it); this
syntax also accepts an XML body (``qwen_xml.XmlCall``). The arguments stream as the model writes
them, once the name is read and the arguments object has begun."""
from __future__ import annotations

import json

from .base import TOOL_CLOSE, ToolParser, ToolSyntax
from .matching import FULL, PARTIAL, WS, match_any
from .qwen_xml import XmlCall
from .values import json_text


class HermesJson(ToolParser):
    syntax = ToolSyntax.HERMES_JSON
    archs = ("qwen3moe",)

    def __init__(self, stream):
        super().__init__(stream)
        self.xml = XmlCall(stream)

    @staticmethod
    def teaches(template: str) -> bool:
        return "<tool_call>" in template

    @staticmethod
    def call_start(name: str | None) -> str:
        return '<tool_call>\n{"name": ' + (f'{json.dumps(name, ensure_ascii=False)}, "arguments": '
                                           if name is not None else '"')

    def body(self, final: bool) -> bool:
        return self.xml.body(final)


class JsonBody:
    """One call's JSON body, read incrementally."""

    def __init__(self, stream):
        self.s = stream
        self.scan = _JsonScan()
        self.streamed = -1              # how much of the arguments object went out (-1: none)

    def body(self, final: bool) -> bool:
        s = self.s
        s.consume(self.scan.feed(s.buf))
        self._stream_arguments()
        if self.scan.closed:
            s.state = self.close
            return True
        return False

    def _member(self, *keys: str) -> tuple[int, int | None] | None:
        members = self.scan.members
        return next((members[k] for k in keys if k in members), None)

    def _stream_arguments(self) -> None:
        """Once the name is read and an arguments object has begun, its text goes out as it comes."""
        s, call, scan = self.s, self.s.call, self.scan
        if call.index is None:
            name = self._member("name")
            args = self._member("arguments", "parameters")
            if not (name and name[1] is not None and args and scan.text[args[0]] == "{"):
                return
            try:
                call.name = json.loads(scan.text[name[0]:name[1]])
            except ValueError:
                return
            if not isinstance(call.name, str) or not call.name:
                return
            s.start_call()
            self.streamed = args[0]
        if self.streamed >= 0:
            start, end = self._member("arguments", "parameters")
            stop = end if end is not None else len(scan.text)
            s.emit_arguments(scan.text[self.streamed:stop])
            self.streamed = stop

    def close(self, final: bool) -> bool:
        s = self.s
        status, _, end, _ = match_any(s.buf, 0, ((WS, TOOL_CLOSE),))
        if status == PARTIAL:
            return False
        call = s.call
        parsed = _hermes_call(self.scan.text) if status == FULL else None
        if parsed is None or (call.index is not None and parsed[0] != call.name):
            s.fail()
            return True
        s.consume(end)
        call.name, call.args = parsed
        if call.index is None:
            s.start_call()
            s.emit_arguments(json_text(call.args))
        s.end_call()
        return True


class _JsonScan:
    """One JSON object read incrementally: where each top-level member's value starts and ends, so
    that a hermes call's name is known and its arguments can stream before the object closes."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0
        self.closed = False
        self.members: dict[str, tuple[int, int | None]] = {}
        self._in_str = self._esc = False
        self._expect = "key"            # key | colon | value | in_value | comma
        self._key_start = 0
        self._key = ""

    def feed(self, s: str) -> int:
        """Scan ``s``; returns how many characters belong to the object (all of them until it closes)."""
        base, text = len(self.text), self.text + s
        for k in range(base, len(text)):
            ch = text[k]
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self.depth == 1 and self._expect == "in_key":
                        try:
                            self._key = json.loads(text[self._key_start:k + 1])
                        except ValueError:
                            self._key = ""
                        self._expect = "colon"
                    elif self.depth == 1 and self._expect == "in_value":
                        self._end_value(k + 1)
                continue
            if ch == '"':
                self._in_str = True
                if self.depth == 1 and self._expect == "key":
                    self._key_start, self._expect = k, "in_key"
                elif self.depth == 1 and self._expect == "value":
                    self._start_value(k)
            elif ch in "{[":
                if self.depth == 1 and self._expect == "value":
                    self._start_value(k)
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self._expect == "in_value":
                    self._end_value(k + 1)
                elif self.depth <= 0:
                    if self._expect == "in_value":
                        self._end_value(len(text[:k].rstrip()))
                    self.closed = True
                    self.text = text[:k + 1]
                    return k + 1 - base
            elif self.depth == 1:
                if ch == ":" and self._expect == "colon":
                    self._expect = "value"
                elif ch == ",":
                    if self._expect == "in_value":
                        self._end_value(len(text[:k].rstrip()))
                    self._expect = "key"
                elif not ch.isspace() and self._expect == "value":
                    self._start_value(k)
        self.text = text
        return len(s)

    def _start_value(self, k: int) -> None:
        self.members[self._key] = (k, None)
        self._expect = "in_value"

    def _end_value(self, k: int) -> None:
        start, _ = self.members[self._key]
        self.members[self._key] = (start, k)
        self._expect = "comma"


def _hermes_call(text: str) -> tuple[str, dict] | None:
    """``{"name": ..., "arguments": {...}}`` (``parameters`` too; arguments as a JSON string too)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None
