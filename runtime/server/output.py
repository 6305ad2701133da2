"""Model text -> visible text, reasoning and tool calls, decided incrementally as tokens arrive.

The three formats are the ones the models' chat templates teach them (llama.cpp's
``models/templates``):

* Qwen3.5/3.6 and Qwen3-Coder (``QWEN_XML``)::

      <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>

* Qwen3 (``HERMES_JSON``): ``<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>``
* Laguna (``LAGUNA``): ``<tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n</tool_call>``

A JSON body inside ``<tool_call>`` is accepted in every format (Qwen models fall back to it), an
XML body in the hermes one, and, as llama.cpp does for Qwen3-Coder, an XML call whose ``<tool_call>``
was left out when it opens with ``<function=NAME>`` of a tool in the request.

Values are raw text, so where a value ends is a choice. llama.cpp ends it at the first
``\\n</parameter>\\n`` (``</arg_value>`` for Laguna); ollama at the first ``</tool_call>``. Both cut
a file whose text contains those tags. Here a value ends only where the rest of the call's
structure follows: ``</parameter>``, optional whitespace, then ``<parameter=NAME>`` or
``</function>`` + ``</tool_call>`` (Laguna: ``</arg_value>`` then ``<arg_key>NAME</arg_key><arg_value>``
or ``</tool_call>``); when the tool's schema lists its properties, NAME must be one of them, which
is what llama.cpp's grammar would have forced. (A value that quotes the whole closing sequence,
``</parameter>`` ``</function>`` ``</tool_call>``, still ends there: while streaming nothing can tell
it from the real end.) As in llama.cpp a value is converted with the
tool's JSON schema (a string stays raw text; number, integer, boolean, null, object and array are
parsed, falling back to the raw text when they do not parse).

Every decision depends on the text only, never on where it was split: text that may be the start
of a tag is held back until the next characters decide it, so any split gives the same events once
adjacent deltas of one kind are merged. Whitespace around the structure (after ``</think>``,
before ``<tool_call>``, between calls) is dropped, as ollama and the templates' own rendering do.
"""
from __future__ import annotations

import enum
import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


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


class ToolSyntax(enum.Enum):
    QWEN_XML = "qwen_xml"
    HERMES_JSON = "hermes_json"
    LAGUNA = "laguna"


_ARCH_SYNTAX = {"qwen35moe": ToolSyntax.QWEN_XML, "qwen3moe": ToolSyntax.HERMES_JSON, "laguna": ToolSyntax.LAGUNA}


def tool_syntax_for(arch: str, chat_template: str) -> ToolSyntax:
    """The template decides (a Qwen3-Coder GGUF is arch ``qwen3moe`` but teaches XML calls); the
    arch only where the template shows no tool-call format."""
    template = chat_template or ""
    if "<arg_key>" in template:
        return ToolSyntax.LAGUNA
    if "<function=" in template and "<parameter=" in template:
        return ToolSyntax.QWEN_XML
    if "<tool_call>" in template:
        return ToolSyntax.HERMES_JSON
    return _ARCH_SYNTAX.get(arch, ToolSyntax.HERMES_JSON)


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Qwen3.5/3.6 (thinking on) end the generation prompt with ``<think>\\n`` and Laguna with
    ``<think>``: the model's first tokens are then reasoning. Only the very end counts, so a
    ``<think>`` quoted earlier in the conversation changes nothing."""
    return prompt_text.rstrip().endswith("<think>")


_CLOSE_REASONING = {ToolSyntax.QWEN_XML: "\n</think>\n\n", ToolSyntax.HERMES_JSON: "\n</think>\n\n",
                    ToolSyntax.LAGUNA: "</think>\n"}


def closed_reasoning(syntax: ToolSyntax) -> str:
    """What closes a reasoning block the prompt opened, as the template renders an empty one."""
    return _CLOSE_REASONING[syntax]


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
    if syntax is ToolSyntax.QWEN_XML:
        call = "<tool_call>\n<function=" + (f"{name}>\n" if name is not None else "")
    elif syntax is ToolSyntax.HERMES_JSON:
        call = '<tool_call>\n{"name": ' + (f'{json.dumps(name, ensure_ascii=False)}, "arguments": '
                                           if name is not None else '"')
    else:
        call = "<tool_call>" + (f"{name}\n" if name is not None else "")
    return (closed_reasoning(syntax) if in_reasoning else "") + call


def _random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


# --- tool schemas: which JSON types a parameter takes ------------------------------------------

_ANY = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
_STRING = frozenset({"string"})


def _schema_types(schema: Any, depth: int = 0) -> frozenset[str]:
    """Every JSON type a schema admits (``_ANY`` when it does not say)."""
    if not isinstance(schema, dict) or depth > 8:
        return _ANY
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(key), list):
            for sub in schema[key]:
                types |= _schema_types(sub, depth + 1)
    if "enum" in schema and isinstance(schema["enum"], list) and not t:
        types.update(_json_type(v) for v in schema["enum"])
    if schema.get("nullable") is True:
        types.add("null")
    if not types:
        if isinstance(schema.get("properties"), dict):
            return frozenset({"object"})
        if "items" in schema:
            return frozenset({"array"})
        return _ANY
    return frozenset(types)


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    return "array" if isinstance(v, list) else "object"


_PY_LITERALS = {"True": True, "False": False, "None": None}  # what Qwen3.5's template renders for Python values


def convert_value(raw: str, types: frozenset[str]) -> Any:
    """A parameter's raw text as the JSON type its schema asks for; raw text when it does not
    parse as one of them (never dropped)."""
    if types == _STRING:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text)
    except ValueError:
        if text not in _PY_LITERALS:
            return raw
        value = _PY_LITERALS[text]
    kind = _json_type(value)
    if kind == "integer" and "integer" not in types and "number" in types:
        return value
    if kind == "number" and "integer" in types and value.is_integer() and "number" not in types:
        return int(value)
    return value if kind in types and kind != "string" else raw


def _tool_params(tools: list[dict] | None) -> dict[str, dict[str, frozenset[str]] | None]:
    """name -> {parameter: types} (None where the tool lists no properties)."""
    out: dict[str, dict[str, frozenset[str]] | None] = {}
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            continue
        props = fn.get("parameters", {}).get("properties") if isinstance(fn.get("parameters"), dict) else None
        out[fn["name"]] = ({k: _schema_types(v) for k, v in props.items()}
                           if isinstance(props, dict) and props else None)
    return out


# --- matching structure against a buffer that may end early ------------------------------------

_WS = object()          # zero or more whitespace characters
_FULL, _PARTIAL, _FAIL = "full", "partial", "fail"
_MAX_NAME = 256


@dataclass(frozen=True)
class _Name:
    """A function/parameter name up to ``close``; with ``known``, only those names match."""
    close: str
    known: frozenset[str] | None = None


def _match(buf: str, pos: int, parts: tuple) -> tuple[str, int, list[str]]:
    """Match ``parts`` (literals, ``_WS``, ``_Name``) at ``buf[pos:]``: full (with the end and the
    names read), partial (the buffer ended while it could still match) or fail."""
    names: list[str] = []
    p = pos
    for part in parts:
        if part is _WS:
            while p < len(buf) and buf[p].isspace():
                p += 1
        elif isinstance(part, str):
            if buf.startswith(part, p):
                p += len(part)
            elif part.startswith(buf[p:]):
                return _PARTIAL, p, names
            else:
                return _FAIL, p, names
        else:
            q = p
            while True:
                if buf.startswith(part.close, q):
                    break
                if q == len(buf) or part.close.startswith(buf[q:]):
                    return _PARTIAL, q, names
                if buf[q] in "<>\n" or q - p >= _MAX_NAME:
                    return _FAIL, q, names
                q += 1
            name = buf[p:q].strip()
            if not name or (part.known is not None and name not in part.known):
                return _FAIL, q, names
            names.append(name)
            p = q + len(part.close)
    if p == len(buf) and parts and parts[-1] is _WS:
        return _PARTIAL, p, names
    return _FULL, p, names


def _match_any(buf: str, pos: int, alternatives: tuple[tuple, ...]) -> tuple[str, int, int, list[str]]:
    """The first alternative that matches fully, else partial if any may still match, else fail;
    returns (status, which alternative, end, names)."""
    partial = False
    for i, parts in enumerate(alternatives):
        status, end, names = _match(buf, pos, parts)
        if status == _FULL:
            return _FULL, i, end, names
        partial |= status == _PARTIAL
    return (_PARTIAL if partial else _FAIL), -1, pos, []


def _held(buf: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf`` that is the start of one of ``tags``."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(buf)), best, -1):
            if buf.endswith(tag[:n]):
                best = n
                break
    return best


_TOOL_OPEN, _TOOL_CLOSE, _THINK_OPEN, _THINK_CLOSE = "<tool_call>", "</tool_call>", "<think>", "</think>"
_FUNCTION_OPEN = "<function="
_VALUE_CANDIDATE = re.compile(r"[\n<]")


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


@dataclass
class _Call:
    """The tool call being read: raw text kept so that a call that never completes becomes text."""
    back: Callable[[bool], bool]         # the state the call interrupted (text or reasoning)
    gap: str                             # whitespace dropped before <tool_call>, given back on failure
    raw: list[str]                       # the call's text so far, from its opening tag
    index: int | None = None             # set when ToolCallStart is out
    name: str = ""
    args: dict = field(default_factory=dict)
    key: str = ""                        # the parameter being read
    types: frozenset[str] = _ANY
    streams: bool = False                # this parameter's text goes out as it arrives
    value: list[str] = field(default_factory=list)
    scan: _JsonScan | None = None
    streamed_json: int = -1              # hermes: how much of the arguments object went out (-1: none)


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


class OutputParser:
    """Feed the model's text as it is decoded; get events back. One parser per generation."""

    def __init__(self, syntax: ToolSyntax, *, in_reasoning: bool, parse_tools: bool, prefix: str = "",
                 tools: list[dict] | None = None, new_id: Callable[[], str] = _random_call_id):
        """``tools`` (OpenAI function-tool form) give parameter types and the names a value may end
        before; ``new_id`` makes each call's id. ``prefix`` is parsed first, its events returned by
        the first ``feed``/``finish``."""
        self.syntax = syntax
        self._parse_tools = parse_tools
        self._tools = _tool_params(tools)
        self._bare_names = (frozenset(self._tools) if syntax is ToolSyntax.QWEN_XML and parse_tools and self._tools
                            else None)
        self._new_id = new_id
        self._buf = ""
        self._out: list[Event] = []
        self._calls = 0
        self._lead = True               # drop the whitespace that opens a text or reasoning span
        self._think_tag = True          # a leading <think> opens (or, in reasoning, repeats) the reasoning
        self._call: _Call | None = None
        self._state: Callable[[bool], bool] = self._reasoning if in_reasoning else self._text
        if prefix:
            self._buf = prefix
            self._run(final=False)

    # public -----------------------------------------------------------------------------------

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        self._run(final=False)
        return self._take_events()

    def finish(self) -> list[Event]:
        self._run(final=True)
        return self._take_events()

    # machinery --------------------------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            if self._state(final):
                continue
            if final and self._call is not None:
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

    def _emit(self, event: Event) -> None:
        if isinstance(event, (TextDelta, ReasoningDelta)) and not event.text:
            return
        if isinstance(event, ToolCallDelta) and not event.arguments:
            return
        self._out.append(event)

    def _consume(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        if self._call is not None:
            self._call.raw.append(taken)
        return taken

    def _strip_lead(self) -> bool:
        """Drop the span's leading whitespace; False while nothing else has arrived."""
        if self._lead:
            stripped = self._buf.lstrip()
            self._buf = stripped
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
            if self._buf.startswith(tag):
                self._buf = self._buf[len(tag):]
                self._think_tag, self._lead = False, True
                return tag
        if not final and any(tag.startswith(self._buf) for tag in tags):
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
                self._state = self._reasoning
            return True
        buf = self._buf
        if not self._parse_tools:
            self._emit(TextDelta(buf))
            self._buf = ""
            return False
        i = buf.find(_TOOL_OPEN)
        bare = self._bare_function(buf, i if i >= 0 else len(buf))
        if bare is not None and bare[1]:
            self._open_call(buf[:bare[0]], back=self._text, kind=TextDelta, tag=_FUNCTION_OPEN)
            return True
        if bare is not None and not final:  # hold the opener and the whitespace before it
            cut = len(buf[:bare[0]].rstrip())
            self._emit(TextDelta(buf[:cut]))
            self._buf = buf[cut:]
            return False
        if i >= 0:
            self._open_call(buf[:i], back=self._text, kind=TextDelta)
            return True
        self._flush_before_tags(TextDelta, (_TOOL_OPEN, _FUNCTION_OPEN) if self._bare_names else (_TOOL_OPEN,), final)
        return False

    def _bare_function(self, buf: str, before: int) -> tuple[int, bool] | None:
        """Qwen3-Coder sometimes leaves out ``<tool_call>``; llama.cpp then takes ``<function=NAME>``
        of a tool in the request as the call's start. Returns where such an opener starts before
        ``before`` and whether it is complete (False: the name is still arriving)."""
        if not self._bare_names:
            return None
        k = buf.find(_FUNCTION_OPEN)
        while 0 <= k < before:
            status, _, _ = _match(buf, k, (_FUNCTION_OPEN, _Name(">", self._bare_names)))
            if status != _FAIL:
                return k, status == _FULL
            k = buf.find(_FUNCTION_OPEN, k + 1)
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
        buf = self._buf
        tags = (_THINK_CLOSE, _TOOL_OPEN) if self._parse_tools else (_THINK_CLOSE,)
        found = [(i, t) for t in tags if (i := buf.find(t)) >= 0]
        if found:
            i, tag = min(found)
            if tag == _THINK_CLOSE:
                self._emit(ReasoningDelta(buf[:i].rstrip()))
                self._buf = buf[i + len(tag):]
                self._state, self._lead, self._think_tag = self._text, True, False
            else:  # Qwen3.5 and Laguna may open a call without closing the reasoning (llama.cpp, ollama)
                self._open_call(buf[:i], back=self._reasoning, kind=ReasoningDelta)
            return True
        self._flush_before_tags(ReasoningDelta, tags, final)
        return False

    def _flush_before_tags(self, kind: type, tags: tuple[str, ...], final: bool) -> None:
        """Emit the buffer but what may start a tag and the whitespace before it."""
        buf = self._buf
        if final:
            keep = 0
        else:
            cut = len(buf) - _held(buf, tags)
            keep = len(buf) - len(buf[:cut].rstrip())
        self._emit(kind(buf[:len(buf) - keep]))
        self._buf = buf[len(buf) - keep:]

    def _open_call(self, before: str, back: Callable[[bool], bool], kind: type, tag: str = _TOOL_OPEN) -> None:
        body = before.rstrip()
        self._emit(kind(body))
        self._buf = self._buf[len(before) + len(tag):]
        self._call = _Call(back=back, gap=before[len(body):], raw=[tag])
        self._state = self._call_body if tag == _TOOL_OPEN else self._xml_function

    # the end of a call, good or bad -----------------------------------------------------------

    def _start(self) -> None:
        call = self._call
        if call.index is None:
            call.index = self._calls
            self._calls += 1
            self._emit(ToolCallStart(call.index, self._new_id(), call.name))

    def _end_call(self) -> None:
        call = self._call
        self._start()
        self._emit(ToolCallEnd(call.index, call.args))
        self._call = None
        self._state, self._lead, self._think_tag = self._text, True, False

    def _fail(self) -> None:
        """Not a tool call after all: its text goes back where it came from; once a
        ToolCallStart is out (that call then never ends), it is visible text."""
        call = self._call
        text = call.gap + "".join(call.raw)
        self._call = None
        if call.index is None and call.back == self._reasoning:
            self._emit(ReasoningDelta(text))
            self._state = self._reasoning
        else:
            self._emit(TextDelta(text))
            self._state = self._text
        self._lead = self._think_tag = False

    def _unterminated(self) -> None:
        self._call.raw.append(self._buf)
        self._buf = ""
        self._fail()

    # the call's body --------------------------------------------------------------------------

    def _call_body(self, final: bool) -> bool:
        buf = self._buf
        stripped = buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == "{":
            self._consume(len(buf) - len(stripped))
            self._call.scan = _JsonScan()
            self._state = self._json_body
            return True
        if self.syntax is ToolSyntax.LAGUNA:
            self._consume(len(buf) - len(stripped))
            self._state = self._laguna_name
            return True
        status, _, end, _ = _match_any(buf, 0, ((_WS, "<function="),))
        if status == _FULL:
            self._consume(end)
            self._state = self._xml_function
            return True
        if status == _PARTIAL:
            return False
        self._fail()
        return True

    def _known(self) -> frozenset[str] | None:
        params = self._tools.get(self._call.name)
        return frozenset(params) if params else None

    def _begin_value(self, key: str) -> None:
        call = self._call
        params = self._tools.get(call.name)
        call.key = key
        call.types = params.get(key, _STRING) if params else _STRING
        call.streams = call.types == _STRING
        call.value = []
        if call.streams:
            self._emit(ToolCallDelta(call.index, ("{" if not call.args else ", ") + _json_text(key) + ': "'))

    def _value_text(self, text: str) -> None:
        call = self._call
        call.value.append(text)
        if call.streams:
            self._emit(ToolCallDelta(call.index, _json_text(text)[1:-1]))

    def _end_value(self) -> None:
        call = self._call
        raw = "".join(call.value)
        if call.streams:
            value, piece = raw, '"'
        else:
            value = convert_value(raw, call.types)
            piece = ("{" if not call.args else ", ") + _json_text(call.key) + ": " + _json_text(value)
        call.args[call.key] = value  # a repeated key: the last value wins, as json.loads does
        self._emit(ToolCallDelta(call.index, piece))

    def _value(self, ends: Callable[[], tuple[tuple, ...]], candidates: re.Pattern, next_key: set[int],
               then: Callable[[bool], bool]) -> bool:
        """Move the value's text out of the buffer up to where the call's structure may resume
        (``ends``, tried where ``candidates`` match); once it does, start the next parameter (the
        alternatives in ``next_key``, continuing in ``then``) or end the call."""
        buf = self._buf
        alts = ends()
        for m in candidates.finditer(buf):
            status, which, end, names = _match_any(buf, m.start(), alts)
            if status == _FAIL:
                continue
            self._value_text(self._consume(m.start()))
            if status == _PARTIAL:
                return False
            self._consume(end - m.start())
            self._end_value()
            if which in next_key:
                self._begin_value(names[0])
                self._state = then
            else:
                self._end_tagged_call()
            return True
        self._value_text(self._consume(len(buf)))
        return False

    def _end_tagged_call(self) -> None:
        self._emit(ToolCallDelta(self._call.index, "}" if self._call.args else "{}"))
        self._end_call()

    # Qwen XML -----------------------------------------------------------------------------------

    def _xml_function(self, final: bool) -> bool:
        """``<function=NAME>``, then the first parameter or the call's end."""
        status, which, end, names = _match_any(self._buf, 0, ((_Name(">"), _WS, "<parameter=", _Name(">")),
                                                              (_Name(">"), _WS, "</function>", _WS, _TOOL_CLOSE)))
        if status == _PARTIAL:
            return False
        if status == _FAIL:
            self._fail()
            return True
        self._consume(end)
        self._call.name = names[0]
        self._start()
        if which == 1:
            self._end_tagged_call()
        else:
            self._begin_value(names[1])
            self._state = self._xml_value_start
        return True

    def _xml_value_start(self, final: bool) -> bool:
        """The template writes a newline after ``<parameter=KEY>``; it is not part of the value."""
        if not self._buf:
            return False
        if self._buf[0] == "\n":
            self._consume(1)
        self._state = self._xml_value
        return True

    def _xml_ends(self) -> tuple[tuple, ...]:
        known = self._known()
        return (("</parameter>", _WS, "<parameter=", _Name(">", known)),
                ("</parameter>", _WS, "</function>", _WS, _TOOL_CLOSE),
                ("\n</parameter>", _WS, "<parameter=", _Name(">", known)),
                ("\n</parameter>", _WS, "</function>", _WS, _TOOL_CLOSE))

    def _xml_value(self, final: bool) -> bool:
        return self._value(self._xml_ends, _VALUE_CANDIDATE, {0, 2}, self._xml_value_start)

    # Laguna ---------------------------------------------------------------------------------------

    def _laguna_name(self, final: bool) -> bool:
        buf = self._buf
        m = re.match(r"[^\s<>]*", buf)
        if m.end() == len(buf):
            if len(buf) > _MAX_NAME:
                self._fail()
                return True
            return False
        name = m.group()
        status, which, end, names = _match_any(buf, m.end(), ((_WS, "<arg_key>", _Name("</arg_key>"), _WS, "<arg_value>"),
                                                              (_WS, _TOOL_CLOSE)))
        if status == _PARTIAL:
            return False
        if status == _FAIL or not name:
            self._fail()
            return True
        self._consume(end)
        self._call.name = name
        self._start()
        if which == 1:
            self._end_tagged_call()
        else:
            self._begin_value(names[0])
            self._state = self._laguna_value
        return True

    def _laguna_ends(self) -> tuple[tuple, ...]:
        return (("</arg_value>", _WS, "<arg_key>", _Name("</arg_key>", self._known()), _WS, "<arg_value>"),
                ("</arg_value>", _WS, _TOOL_CLOSE))

    def _laguna_value(self, final: bool) -> bool:
        return self._value(self._laguna_ends, _LAGUNA_CANDIDATE, {0}, self._laguna_value)

    # JSON body (hermes; accepted in every format) -------------------------------------------------

    def _json_body(self, final: bool) -> bool:
        call = self._call
        scan = call.scan
        n = scan.feed(self._buf)
        self._consume(n)
        self._stream_json_arguments()
        if scan.closed:
            self._state = self._json_close
            return True
        return False

    def _json_member(self, *keys: str) -> tuple[int, int | None] | None:
        members = self._call.scan.members
        return next((members[k] for k in keys if k in members), None)

    def _stream_json_arguments(self) -> None:
        """Once the name is read and an arguments object has begun, its text goes out as it comes."""
        call, scan = self._call, self._call.scan
        if call.index is None:
            name = self._json_member("name")
            args = self._json_member("arguments", "parameters")
            if not (name and name[1] is not None and args and scan.text[args[0]] == "{"):
                return
            try:
                call.name = json.loads(scan.text[name[0]:name[1]])
            except ValueError:
                return
            if not isinstance(call.name, str) or not call.name:
                return
            self._start()
            call.streamed_json = args[0]
        if call.streamed_json >= 0:
            start, end = self._json_member("arguments", "parameters")
            stop = end if end is not None else len(scan.text)
            self._emit(ToolCallDelta(call.index, scan.text[call.streamed_json:stop]))
            call.streamed_json = stop

    def _json_close(self, final: bool) -> bool:
        status, _, end, _ = _match_any(self._buf, 0, ((_WS, _TOOL_CLOSE),))
        if status == _PARTIAL:
            return False
        call = self._call
        parsed = _hermes_call(call.scan.text) if status == _FULL else None
        if parsed is None or (call.index is not None and parsed[0] != call.name):
            self._fail()
            return True
        self._consume(end)
        call.name, call.args = parsed
        if call.index is None:
            self._start()
            self._emit(ToolCallDelta(call.index, _json_text(call.args)))
        self._end_call()
        return True


_LAGUNA_CANDIDATE = re.compile(r"<")


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
