"""Structured outputs through the official SDKs against a real ``spark-run --serve`` process: OpenAI
chat ``response_format``, Responses ``text.format`` and Anthropic ``output_config.format``.

The tiny model's random weights never write JSON by themselves, so a reply that parses and
matches its schema shows the grammar at work; its greedy tokens are compared with an in-process
session decoding under the same grammar. A format the library cannot compile is a 400 in the
route's dialect, before any generation.
"""
from __future__ import annotations

import json
from typing import Literal

import anthropic
import openai
import pytest
from pydantic import BaseModel

from sparkpack.formats.gguf_file import GGUFModel
from sparkpack.runtime.generate import continue_tokens
from sparkpack.runtime.grammar import SchemaGrammars
from sparkpack.runtime.tokenizer import GGUFTokenizer
from tests.gguf_edit import rewrite
from tests.schema_check import problems
from tests.serve_proc import ServerProcess, fresh_session, one_thread

CALL, CTX = 16, 512
VERDICT = {"type": "object", "additionalProperties": False, "required": ["ok", "color", "count", "note"],
           "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                          "count": {"type": "integer", "minimum": 0, "maximum": 99},
                          "note": {"type": "string", "maxLength": 16}}}
# Claude Code's session-title request (2.1.197: read from its bundle, querySource generate_session_title)
CLAUDE_TITLE = {"type": "object", "properties": {"title": {"type": "string"}}, "required": ["title"],
                "additionalProperties": False}
# the same with its string bounded: a random model never ends a free string by itself
TITLE = {**CLAUDE_TITLE, "properties": {"title": {"type": "string", "maxLength": 40}}}
LOOKAROUND = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)y"}}}


class Verdict(BaseModel):
    """For the SDKs' ``parse`` (no free string: Anthropic's SDK moves maxLength into the description)."""

    ok: bool
    color: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def model_path(synth_model, tmp_path_factory):
    """The tiny qwen35moe with a template whose generation prompt opens ``<think>\n`` unless
    thinking is off, as Qwen3.5/3.6's do: the grammar must start after the reasoning closes."""
    src = synth_model("qwen35moe")
    template = GGUFModel(src).get("tokenizer.chat_template")
    off = "{{- '<think>\\n\\n</think>\\n\\n' }}"
    assert template.count(off) == 1
    opened = template.replace(off, off + "\n    {%- else %}\n        {{- '<think>\\n' }}")
    return rewrite(src, tmp_path_factory.mktemp("thinking") / "qwen35moe-thinking.gguf",
                   {"tokenizer.chat_template": opened})


@pytest.fixture(scope="module")
def server(model_path, tmp_path_factory):
    proc = ServerProcess(model_path, "--ctx", str(CTX), "--prefill-chunk", str(CALL),
                         hooks=tmp_path_factory.mktemp("hooks"))
    yield proc
    assert proc.stop() == 0, "".join(proc.stderr)


@pytest.fixture(scope="module")
def oai(server):
    return server.openai()


@pytest.fixture(scope="module")
def claude(server):
    return server.anthropic()


def dumps(server) -> list[int]:
    return sorted(int(p.stem) for p in server.hooks.glob("*.json"))


def last_dump(server) -> dict:
    return json.loads((server.hooks / f"{dumps(server)[-1]}.json").read_text())


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def matches(text: str, schema: dict) -> dict:
    value = json.loads(text)
    assert problems(value, schema) == [], (text, problems(value, schema))
    return value


def test_chat_response_format_json_schema(server, oai, model_path):
    """Plain, streamed and the SDK's own ``parse``: JSON matching the schema, the reasoning the
    template opened closed before it, and the tokens of an in-process session under the grammar."""
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": VERDICT, "strict": True}}
    r = oai.chat.completions.create(model="x", messages=user("Is it red?"), max_tokens=200, response_format=fmt)
    message = r.choices[0].message
    matches(message.content, VERDICT)
    assert r.choices[0].finish_reason == "stop" and not message.model_extra.get("reasoning_content")
    dump = last_dump(server)
    tok = GGUFTokenizer.from_metadata(GGUFModel(model_path))
    assert tok.decode(dump["prompt"]).endswith("<think>\n\n</think>\n\n")
    with one_thread():
        session = fresh_session(model_path, CALL, CTX)
        grammar = SchemaGrammars(tok, session.model.spec.n_vocab).json_schema(VERDICT)
        reference = list(continue_tokens(session, session.prompt(dump["prompt"]), None, 200, tok.stop_ids, grammar))
    assert dump["tokens"] == reference
    streamed = oai.chat.completions.create(model="x", messages=user("Is it red?"), max_tokens=200,
                                           response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == message.content
    parsed = oai.chat.completions.parse(model="x", messages=user("Is it red?"), max_tokens=200,
                                        response_format=Verdict).choices[0].message.parsed
    assert isinstance(parsed, Verdict)


def test_chat_json_object_mode(server, oai):
    """``json_object``: a JSON object from the first token; the test hook's forced text passes
    the grammar when it is JSON and fails the request (500) when it is not: no token skips it."""
    r = oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=6,
                                    response_format={"type": "json_object"})
    assert r.choices[0].message.content.startswith("{") and r.choices[0].finish_reason == "length"
    fmt = {"type": "json_object"}
    r = oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=50, response_format=fmt,
                                    extra_body={"sparkpack_test_output": '{"a":[1,true],"b":null}'})
    assert json.loads(r.choices[0].message.content) == {"a": [1, True], "b": None}
    with pytest.raises(openai.InternalServerError, match="grammar"):
        oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=50, response_format=fmt,
                                    extra_body={"sparkpack_test_output": "no JSON here"})


def test_responses_text_format(oai):
    fmt = {"type": "json_schema", "name": "verdict", "schema": VERDICT, "strict": True}
    r = oai.responses.create(model="x", input="Is it red?", max_output_tokens=200, text={"format": fmt})
    matches(r.output_text, VERDICT)
    assert r.status == "completed" and r.text.format.type == "json_schema"
    assert [item.type for item in r.output] == ["message"]
    events = oai.responses.create(model="x", input="Is it red?", max_output_tokens=200, text={"format": fmt},
                                  stream=True)
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == r.output_text
    parsed = oai.responses.parse(model="x", input="Is it red?", max_output_tokens=200, text_format=Verdict)
    assert isinstance(parsed.output_parsed, Verdict)


@pytest.mark.slow
def test_anthropic_output_config_format(claude):
    """Claude Code's title call: ``output_config.format`` with thinking on; the reply is one text
    block holding the JSON (streamed the same); the SDK's ``parse``, its beta client with the
    structured-outputs header, and the older beta's top-level ``output_format`` too."""
    kw = dict(model="x", max_tokens=200, messages=user("Name this conversation."),
              thinking={"type": "enabled", "budget_tokens": 100})
    m = claude.messages.create(**kw, output_config={"format": {"type": "json_schema", "schema": TITLE}})
    assert [b.type for b in m.content] == ["text"] and m.stop_reason == "end_turn"
    matches(m.content[0].text, TITLE)
    with claude.messages.stream(**kw, output_config={"format": {"type": "json_schema", "schema": TITLE}}) as s:
        assert s.get_final_text() == m.content[0].text
    beta = claude.messages.create(**kw, extra_body={"output_format": {"type": "json_schema", "schema": TITLE}})
    assert beta.content[0].text == m.content[0].text
    beta = claude.beta.messages.create(**kw, betas=["structured-outputs-2025-11-13"],
                                       output_config={"format": {"type": "json_schema", "schema": TITLE}})
    assert beta.content[0].text == m.content[0].text
    parsed = claude.messages.parse(model="x", max_tokens=200, messages=user("Is it red?"), output_format=Verdict)
    assert isinstance(parsed.parsed_output, Verdict)
    cut = claude.messages.create(**{**kw, "max_tokens": 12},
                                 output_config={"format": {"type": "json_schema", "schema": CLAUDE_TITLE}})
    assert cut.stop_reason == "max_tokens" and cut.content[0].text.startswith('{"title":"')


def test_formats_that_cannot_be_honoured_are_400s_in_each_dialect(server, oai, claude):
    """Never a 200 with free text: an uncompilable schema, an unknown format type or a forced
    tool call beside a format is refused before the engine sees the request."""
    before = dumps(server)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=20, response_format={
            "type": "json_schema", "json_schema": {"name": "a", "schema": LOOKAROUND}})
    assert e.value.body["param"] == "response_format" and "look-around" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=20, response_format={"type": "xml"})
    assert e.value.body["param"] == "response_format.type"
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model="x", input="hi", max_output_tokens=20,
                             text={"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}})
    assert e.value.body["param"] == "text.format"
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="x", messages=user("hi"), max_tokens=20, tools=[tool],
                                    tool_choice="required", response_format={"type": "json_object"})
    assert e.value.body["param"] == "tool_choice"
    for fmt in ({"type": "json_schema", "schema": LOOKAROUND}, {"type": "json_object"}):
        with pytest.raises(anthropic.BadRequestError) as e:
            claude.messages.create(model="x", max_tokens=20, messages=user("hi"), output_config={"format": fmt})
        assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
        assert e.value.body["error"]["message"].startswith("output_config.format")
    with pytest.raises(anthropic.BadRequestError, match="output_format: .*look-around"):
        claude.messages.create(model="x", max_tokens=20, messages=user("hi"),
                               extra_body={"output_format": {"type": "json_schema", "schema": LOOKAROUND}})
    assert dumps(server) == before


def test_format_fields_of_each_dialect():
    """What each dialect's format field asks for: free text (None), any JSON object, or a schema;
    a malformed one names its field."""
    from sparkpack.runtime.server.messages import (RequestError, anthropic_output_schema, openai_chat_output_schema,
                                                   responses_output_schema)

    assert openai_chat_output_schema({}) is None
    assert openai_chat_output_schema({"response_format": {"type": "text"}}) is None
    assert openai_chat_output_schema({"response_format": {"type": "json_object"}}) == {"type": "object"}
    assert openai_chat_output_schema({"response_format": {"type": "json_schema", "json_schema": {
        "name": "v", "schema": VERDICT, "strict": True}}}) == VERDICT
    assert responses_output_schema({"text": {"verbosity": "low"}}) is None
    assert responses_output_schema({"text": {"format": {"type": "json_schema", "name": "v", "schema": TITLE}}}) == TITLE
    assert anthropic_output_schema({"output_config": {"effort": "low"}}) is None
    assert anthropic_output_schema({"output_config": {"format": {"type": "json_schema", "schema": TITLE}}}) == TITLE
    assert anthropic_output_schema({"output_format": {"type": "json_schema", "schema": TITLE}}) == TITLE
    for read, body, param in [
        (openai_chat_output_schema, {"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (openai_chat_output_schema, {"response_format": {"type": "json_schema", "json_schema": {"schema": []}}},
         "response_format.json_schema.schema"),
        (responses_output_schema, {"text": "json"}, "text"),
        (anthropic_output_schema, {"output_config": {"format": {"type": "text"}}}, "output_config.format.type"),
    ]:
        with pytest.raises(RequestError) as e:
            read(body)
        assert e.value.param == param
