"""The output parser on recorded-style model outputs (tests/server_outputs.py): the right content,
reasoning and tool calls, and the same events for every way the text can arrive (a split at every
character boundary, one character at a time, random chunks)."""
from __future__ import annotations

import json
import random

import pytest

from sparkpack.runtime.server.output import (OutputParser, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd,
                                             ToolCallStart, ToolSyntax, convert_value, forced_prefix,
                                             prompt_opens_reasoning, tool_syntax_for)
from sparkpack.runtime.server.tool_parsers import BY_SYNTAX
from tests.server_outputs import CASES, HERMES, LAGUNA, QWEN, TOOLS, Case


def _parser(syntax: ToolSyntax, in_reasoning: bool, tools=TOOLS, parse_tools: bool = True, prefix: str = "") -> OutputParser:
    counter = iter(range(1000))
    return OutputParser(syntax, in_reasoning=in_reasoning, parse_tools=parse_tools, prefix=prefix, tools=tools,
                        new_id=lambda: f"call_{next(counter)}")


def run(case_or_syntax, chunks: list[str], in_reasoning: bool = False, **kw) -> list:
    if isinstance(case_or_syntax, Case):
        parser = _parser(case_or_syntax.syntax, case_or_syntax.in_reasoning, **kw)
    else:
        parser = _parser(case_or_syntax, in_reasoning, **kw)
    events = []
    for chunk in chunks:
        events += parser.feed(chunk)
    return events + parser.finish()


def merged(events: list) -> list:
    """Adjacent deltas of one kind (and one call) joined: what every split must agree on."""
    out: list = []
    for e in events:
        last = out[-1] if out else None
        if isinstance(e, (TextDelta, ReasoningDelta)) and type(last) is type(e):
            out[-1] = type(e)(last.text + e.text)
        elif isinstance(e, ToolCallDelta) and isinstance(last, ToolCallDelta) and last.index == e.index:
            out[-1] = ToolCallDelta(e.index, last.arguments + e.arguments)
        else:
            out.append(e)
    return out


def summary(events: list) -> tuple[str, str, list[tuple[str, dict]]]:
    """Content, reasoning and finished calls, after checking the stream's own invariants: a call's
    deltas come between its start and end, and their text parses to the end's arguments."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    names, texts, calls, ended = {}, {}, [], set()
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index not in names and e.index == len(names), e
            names[e.index], texts[e.index] = e.name, ""
        elif isinstance(e, ToolCallDelta):
            assert e.index in names and e.index not in ended, e
            texts[e.index] += e.arguments
        elif isinstance(e, ToolCallEnd):
            assert e.index in names and e.index not in ended, e
            assert json.loads(texts[e.index]) == e.arguments, (texts[e.index], e.arguments)
            ended.add(e.index)
            calls.append((names[e.index], e.arguments))
    return content, reasoning, calls


def _expect(case: Case, events: list) -> None:
    content, reasoning, calls = summary(events)
    assert content == case.content
    assert reasoning == case.reasoning
    assert calls == [(n, a) for n, a in case.calls]


@pytest.mark.parametrize("case", CASES, ids=[f"{c.syntax.value}-{c.name}" for c in CASES])
def test_recorded_output_parses_to_its_calls(case: Case) -> None:
    _expect(case, run(case, [case.text]))


@pytest.mark.parametrize("case", CASES, ids=[f"{c.syntax.value}-{c.name}" for c in CASES])
def test_every_split_point_gives_the_same_events(case: Case) -> None:
    whole = merged(run(case, [case.text]))
    text = case.text
    for i in range(1, len(text)):
        assert merged(run(case, [text[:i], text[i:]])) == whole, f"split at {i}: {text[:i][-20:]!r} | {text[i:][:20]!r}"
    one_by_one = run(case, list(text))
    assert merged(one_by_one) == whole
    _expect(case, one_by_one)


@pytest.mark.parametrize("case", CASES, ids=[f"{c.syntax.value}-{c.name}" for c in CASES])
def test_random_chunks_give_the_same_events(case: Case) -> None:
    whole = merged(run(case, [case.text]))
    rng = random.Random(case.name)
    for _ in range(30):
        cuts = sorted(rng.sample(range(1, len(case.text)), k=min(len(case.text) - 1, rng.randint(1, 12))))
        chunks = [case.text[a:b] for a, b in zip([0, *cuts], [*cuts, len(case.text)])]
        assert merged(run(case, chunks)) == whole, cuts


def test_every_registered_syntax_has_recorded_cases() -> None:
    """The split and chunk tests above run each parser in the registry on its own outputs."""
    assert {c.syntax for c in CASES} == set(BY_SYNTAX)


def test_held_back_text_waits_only_for_a_possible_tag() -> None:
    p = _parser(QWEN, in_reasoning=False)
    assert p.feed("Hello wor") == [TextDelta("Hello wor")]
    assert p.feed("ld <tool") == [TextDelta("ld")]           # " <tool" may open a call
    assert p.feed("box>") == [TextDelta(" <toolbox>")]       # it did not
    assert p.feed(" a\n\n") == [TextDelta(" a")]              # trailing whitespace waits for what follows
    assert p.finish() == [TextDelta("\n\n")]                 # the end keeps it


def test_tool_call_streams_its_arguments_before_the_call_ends() -> None:
    p = _parser(QWEN, in_reasoning=False)
    events = p.feed("<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\nline 1\n")
    assert events[0] == ToolCallStart(0, "call_0", "write_file")
    assert events[1:] == [ToolCallDelta(0, '{"path": "a.py", "content": "line 1')]  # the newline may end the value
    assert p.feed("line 2\n") == [ToolCallDelta(0, "\\nline 2")]
    assert p.feed("</parameter>\n</function>\n</tool_call>") == [
        ToolCallDelta(0, '"}'), ToolCallEnd(0, {"path": "a.py", "content": "line 1\nline 2"})]
    assert p.finish() == []


def test_hermes_arguments_stream_as_the_model_writes_them() -> None:
    p = _parser(HERMES, in_reasoning=False)
    assert p.feed('<tool_call>\n{"name": "bash", "argu') == []
    assert p.feed('ments": {"command": "echo }') == [ToolCallStart(0, "call_0", "bash"),
                                                      ToolCallDelta(0, '{"command": "echo }')]
    assert p.feed('"}}\n</tool_call>') == [ToolCallDelta(0, '"}'), ToolCallEnd(0, {"command": "echo }"})]


def test_unterminated_call_after_its_start_becomes_text_without_an_end() -> None:
    text = "Plan:\n<tool_call>\n<function=bash>\n<parameter=command>\nrm -rf build"
    events = run(QWEN, [text])
    assert isinstance(events[1], ToolCallStart) and not any(isinstance(e, ToolCallEnd) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text


def test_unterminated_call_in_reasoning_returns_to_reasoning() -> None:
    events = run(QWEN, ["I could write <tool_call>\n<function=ba"], in_reasoning=True)
    assert merged(events) == [ReasoningDelta("I could write <tool_call>\n<function=ba")]


def test_without_tools_tags_are_text() -> None:
    text = "<tool_call>\n<function=bash>\n</function>\n</tool_call>"
    assert merged(run(QWEN, [text], parse_tools=False)) == [TextDelta(text)]
    assert merged(run(QWEN, ["why\n</think>\n\n" + text], in_reasoning=True, parse_tools=False)) == [
        ReasoningDelta("why"), TextDelta(text)]


def test_reasoning_cut_off_by_max_tokens_stays_reasoning() -> None:
    assert merged(run(QWEN, ["Thinking about </thi"], in_reasoning=True)) == [ReasoningDelta("Thinking about </thi")]


def test_unknown_tool_and_no_tools_keep_values_as_strings() -> None:
    text = "<tool_call>\n<function=mystery>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    for tools in (None, TOOLS):
        assert summary(run(QWEN, [text], tools=tools))[2] == [("mystery", {"n": "5"})]


def test_without_a_schema_any_parameter_name_ends_a_value() -> None:
    """The known-name check needs a schema; without one the first structural end wins (llama.cpp's rule)."""
    text = ("<tool_call>\n<function=edit_file>\n<parameter=new_string>\na\n</parameter>\n<parameter=zzz>\nb\n"
            "</parameter>\n</function>\n</tool_call>")
    assert summary(run(QWEN, [text], tools=None))[2] == [("edit_file", {"new_string": "a", "zzz": "b"})]
    assert summary(run(QWEN, [text]))[2] == [("edit_file", {"new_string": "a\n</parameter>\n<parameter=zzz>\nb"})]


@pytest.mark.parametrize("syntax", [QWEN, HERMES, LAGUNA])
@pytest.mark.parametrize("in_reasoning", [False, True])
def test_forced_prefix_parses_as_the_start_of_the_call(syntax: ToolSyntax, in_reasoning: bool) -> None:
    rest = {QWEN: "<parameter=path>\nx.py\n</parameter>\n</function>\n</tool_call>",
            HERMES: '{"path": "x.py"}}\n</tool_call>',
            LAGUNA: "<arg_key>path</arg_key>\n<arg_value>x.py</arg_value>\n</tool_call>"}[syntax]
    prefix = forced_prefix(syntax, {"name": "read_file"}, in_reasoning=in_reasoning)
    events = run(syntax, [rest], in_reasoning=in_reasoning, prefix=prefix)
    assert summary(events) == ("", "", [("read_file", {"path": "x.py"})])
    assert isinstance(events[0], ToolCallStart)
    # the same as the model writing the whole call itself
    assert merged(events) == merged(run(syntax, [prefix + rest], in_reasoning=in_reasoning))


@pytest.mark.parametrize("syntax", [QWEN, HERMES, LAGUNA])
def test_required_prefix_lets_the_model_pick_the_tool(syntax: ToolSyntax) -> None:
    rest = {QWEN: "bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
            HERMES: 'bash", "arguments": {"command": "ls"}}\n</tool_call>',
            LAGUNA: "bash\n<arg_key>command</arg_key>\n<arg_value>ls</arg_value>\n</tool_call>"}[syntax]
    events = run(syntax, [rest], prefix=forced_prefix(syntax, "required"))
    assert summary(events)[2] == [("bash", {"command": "ls"})]


def test_forced_prefix_is_empty_for_auto_and_none_and_closes_reasoning() -> None:
    assert forced_prefix(QWEN, "auto") == forced_prefix(LAGUNA, "none", in_reasoning=True) == ""
    assert forced_prefix(QWEN, "required", in_reasoning=True) == "\n</think>\n\n<tool_call>\n<function="
    assert forced_prefix(LAGUNA, {"name": "bash"}) == "<tool_call>bash\n"
    with pytest.raises(ValueError):
        forced_prefix(QWEN, {"type": "function"})


def test_tool_syntax_follows_the_template_before_the_arch() -> None:
    from sparkpack.repack.synth.metadata import chat_template

    assert tool_syntax_for("qwen35moe", "... <tool_call>\n<function=x>\n<parameter=y> ...") is QWEN
    assert tool_syntax_for("qwen3moe", "<tool_call><function= ... <parameter=") is QWEN  # Qwen3-Coder
    assert tool_syntax_for("qwen35moe", chat_template("qwen35moe")) is HERMES           # our synthetic template
    assert tool_syntax_for("laguna", chat_template("laguna")) is LAGUNA
    assert tool_syntax_for("qwen35moe", "") is QWEN and tool_syntax_for("laguna", "") is LAGUNA
    assert tool_syntax_for("qwen3moe", "{{ messages }}") is HERMES


def test_prompt_opens_reasoning_only_at_its_end() -> None:
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert prompt_opens_reasoning("<assistant>\n<think>")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<assistant>\n</think>")
    assert not prompt_opens_reasoning("user: what does <think> do?\n<|im_start|>assistant\n")


@pytest.mark.parametrize("raw,types,want", [
    ("42", {"integer"}, 42), ("42.0", {"integer"}, 42), ("4.5", {"integer"}, "4.5"), (" 3 ", {"number"}, 3),
    ("2.5", {"number"}, 2.5), ("true", {"boolean"}, True), ("False", {"boolean"}, False), ("yes", {"boolean"}, "yes"),
    ("null", {"string", "null"}, None), ("None", {"integer", "null"}, None), ("null", {"string"}, "null"),
    ("[1, 2]", {"array"}, [1, 2]), ('{"a": {}}', {"object"}, {"a": {}}), ("[1", {"array"}, "[1"),
    ("12", {"string", "integer"}, 12), ("abc", {"string", "integer"}, "abc"), ('"q"', {"string", "integer"}, '"q"'),
    ("007", {"string"}, "007"), ("{}", {"array"}, "{}"),
])
def test_values_take_the_schema_type_or_stay_text(raw: str, types: set[str], want) -> None:
    got = convert_value(raw, frozenset(types))
    assert got == want and type(got) is type(want)


def test_bare_function_opener_needs_a_tool_of_that_name() -> None:
    text = "See <function=bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>"
    assert summary(run(QWEN, [text]))[2] == [("bash", {"command": "ls"})]
    for syntax, tools in ((QWEN, None), (HERMES, TOOLS), (LAGUNA, TOOLS)):
        assert merged(run(syntax, [text], tools=tools)) == [TextDelta(text)]
    held = _parser(QWEN, in_reasoning=False)
    assert held.feed("x <function=ba") == [TextDelta("x")]
    assert held.feed("sh2>") == [TextDelta(" <function=bash2>")]


def test_a_reply_ends_when_its_parser_fails_at_the_end() -> None:
    """``EventStream.end`` posts ``Finished`` even when the parser raises there (one that failed
    on a token fails again at the end): the client's reply ends, it does not wait forever."""
    import asyncio

    from sparkpack.runtime.server.engine import Outcome
    from sparkpack.runtime.server.stream import EventStream, Finished

    class Decoder:
        def push(self, token_id: int) -> str:
            return "x"

        def flush(self) -> str:
            return ""

    class Tokenizer:
        def decoder(self, skip_special: bool) -> Decoder:
            return Decoder()

    class Broken:
        def feed(self, text: str) -> list:
            return [TextDelta(text)] if text else []

        def finish(self) -> list:
            raise ValueError("the parser broke")

    async def until_finished(stream: EventStream) -> list:
        items = []
        async for item in stream.events():
            items.append(item)
            if isinstance(item, Finished):
                return items

    loop = asyncio.new_event_loop()
    try:
        stream = EventStream(loop, Tokenizer(), Broken(), stops=[])
        stream.token(1)
        with pytest.raises(ValueError):
            stream.end(Outcome(finish="length", prompt_tokens=1, completion_tokens=1))
        items = loop.run_until_complete(asyncio.wait_for(until_finished(stream), 5))
    finally:
        loop.close()
    assert items[0] == [TextDelta("x")] and isinstance(items[-1], Finished)
