"""Request dialects -> one canonical conversation, and that conversation through the models' chat
templates: our synthetic ones, a Qwen3.5-shaped one written here, and llama.cpp's real ones
(Qwen3.5, Qwen3-Coder, Qwen3, Laguna) when llama-cpp-python's source package is on this machine.
The strongest check: a parsed model output, made into the canonical assistant message and rendered
by the model's own template, parses back to the same calls."""
from __future__ import annotations

import json
import random
import tarfile
from functools import lru_cache
from pathlib import Path

import pytest

from sparkpack.formats.errors import SparkpackError
from sparkpack.repack.synth.metadata import chat_template
from sparkpack.runtime.chat_template import ChatTemplate
from sparkpack.runtime.server.messages import (Conversation, RequestError, from_anthropic, from_openai_chat,
                                               from_responses)
from sparkpack.runtime.server.output import (ReasoningDelta, TextDelta, ToolCallEnd, ToolCallStart, ToolSyntax,
                                             OutputParser, prompt_opens_reasoning)
from tests.paths import SDIST_HINT, sdist_candidates
from tests.server_outputs import CASES, TOOLS, Case

# --- where the real templates come from --------------------------------------------------------

REAL = {"qwen3.5": "Qwen3.5-4B.jinja", "qwen3-coder": "Qwen3-Coder.jinja", "qwen3": "Qwen-Qwen3-0.6B.jinja",
        "laguna-xs.2": "poolside-Laguna-XS.2.jinja", "laguna-xs-2.1": "poolside-Laguna-XS-2.1.jinja",
        "laguna-s-2.1": "poolside-Laguna-S-2.1.jinja"}


@lru_cache(maxsize=1)
def real_templates() -> dict[str, str]:
    """llama.cpp's templates (``vendor/llama.cpp/models/templates``), read at test time, never copied here."""
    want = set(REAL.values())
    for source in sdist_candidates():
        got: dict[str, str] = {}
        if source.is_dir():
            for path in source.rglob("models/templates/*.jinja"):
                if path.name in want:
                    got[path.name] = path.read_text()
        elif source.is_file():
            with tarfile.open(source) as tar:
                for member in tar:
                    name = member.name.rsplit("/", 1)[-1]
                    if "/models/templates/" in member.name and name in want:
                        got[name] = tar.extractfile(member).read().decode()
        if got.keys() == want:
            return {key: got[file] for key, file in REAL.items()}
    return {}


def real(key: str) -> str:
    templates = real_templates()
    if not templates:
        pytest.skip(SDIST_HINT)
    return templates[key]


# A template in the shape of Qwen3.5's (written here, so CI always has one): arguments iterated with
# |items, scalars printed with |string, a second system message refused, reasoning kept after the
# last user query, tool results grouped into one user turn.
QWEN35_SHAPED = """
{%- if messages[0].role == 'system' or tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if tools %}
        {{- '# Tools\\n<tools>' }}
        {%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
        {{- '\\n</tools>\\nCall as <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>' }}
    {%- endif %}
    {%- if messages[0].role == 'system' %}{{- '\\n\\n' + messages[0].content }}{%- endif %}
    {{- '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=0) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
    {%- if m.role == 'system' %}
        {%- if not loop.first %}{{- raise_exception('System message must be at the beginning.') }}{%- endif %}
    {%- elif m.role == 'user' %}
        {{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query %}
            {{- '<think>\\n' + (m.reasoning_content or '') | trim + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- m.content | trim }}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function %}
            {{- ('\\n\\n' if loop.first and m.content | trim else ('' if loop.first else '\\n')) + '<tool_call>\\n<function=' + fn.name + '>\\n' }}
            {%- for key, value in fn.arguments | items %}
                {{- '<parameter=' + key + '>\\n' }}
                {{- value | tojson if value is mapping or (value is sequence and value is not string) else value | string }}
                {{- '\\n</parameter>\\n' }}
            {%- endfor %}
            {{- '</function>\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {{- '<think>\\n\\n</think>\\n\\n' if enable_thinking is defined and enable_thinking is false else '<think>\\n' }}
{%- endif %}
"""

# (template source, special tokens, syntax, end of an assistant turn)
TEMPLATES = {
    "synthetic-qwen": (lambda: chat_template("qwen3moe"), ToolSyntax.HERMES_JSON, "<|im_end|>\n"),
    "synthetic-laguna": (lambda: chat_template("laguna"), ToolSyntax.LAGUNA, "</assistant>\n"),
    "qwen3.5-shaped": (lambda: QWEN35_SHAPED, ToolSyntax.QWEN_XML, "<|im_end|>\n"),
    "qwen3.5": (lambda: real("qwen3.5"), ToolSyntax.QWEN_XML, "<|im_end|>\n"),
    "qwen3-coder": (lambda: real("qwen3-coder"), ToolSyntax.QWEN_XML, "<|im_end|>\n"),
    "qwen3": (lambda: real("qwen3"), ToolSyntax.HERMES_JSON, "<|im_end|>\n"),
    "laguna-xs.2": (lambda: real("laguna-xs.2"), ToolSyntax.LAGUNA, "</assistant>\n"),
    "laguna-xs-2.1": (lambda: real("laguna-xs-2.1"), ToolSyntax.LAGUNA, "</assistant>\n"),
    "laguna-s-2.1": (lambda: real("laguna-s-2.1"), ToolSyntax.LAGUNA, "</assistant>\n"),
}


def template(key: str) -> ChatTemplate:
    return ChatTemplate(TEMPLATES[key][0](), bos_token="<s>", eos_token="<|im_end|>")


def render(key: str, conv: Conversation, **kw) -> str:
    return template(key).render(conv.messages, tools=conv.tools, **conv.template_kwargs, **kw)


# --- requests as the agents send them -------------------------------------------------------------

def claude_code_request() -> dict:
    return {
        "model": "claude-sonnet-4-5", "max_tokens": 32000, "stream": True,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch=a5145;"},
                   {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
                    "cache_control": {"type": "ephemeral"}},
                   {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks."}],
        "tools": [{"name": "Read", "description": "Reads a file", "input_schema": {
                      "type": "object", "properties": {"file_path": {"type": "string"}, "limit": {"type": "integer"}},
                      "required": ["file_path"]}},
                  {"name": "Bash", "description": "Runs a command", "input_schema": {
                      "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}},
                  {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "<system-reminder>\nContext.\n</system-reminder>"},
                                         {"type": "text", "text": "Why does test_parse fail?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Read the test first.", "signature": "sig"},
                {"type": "text", "text": "Let me read the test."},
                {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"file_path": "/src/test_parse.py", "limit": 50}},
                {"type": "tool_use", "id": "toolu_02", "name": "Bash", "input": {"command": "pytest -q -k parse"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": "def test_parse():\n    assert parse('{}') == {}"},
                {"type": "tool_result", "tool_use_id": "toolu_02", "is_error": True,
                 "content": [{"type": "text", "text": "1 failed"}, {"type": "text", "text": "E  KeyError: 'a'"}]},
                {"type": "text", "text": "Go on."}]},
            {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "abc"},
                                              {"type": "text", "text": "The parser drops empty objects."}]},
            {"role": "user", "content": "Fix it."},
        ],
        "thinking": {"type": "enabled", "budget_tokens": 4000},
    }


def codex_request() -> dict:
    return {
        "model": "gpt-5-codex", "instructions": "You are Codex, a coding agent.", "stream": True, "store": False,
        "reasoning": {"effort": "medium", "summary": "auto"}, "include": ["reasoning.encrypted_content"],
        "tools": [{"type": "function", "name": "shell", "description": "Runs a shell command",
                   "parameters": {"type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}},
                                                                    "workdir": {"type": "string"}},
                                  "required": ["command"]}, "strict": False},
                  {"type": "web_search"}, {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
                  {"type": "local_shell"}],
        "tool_choice": "auto", "parallel_tool_calls": False,
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "<permissions>sandboxed</permissions>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>cwd=/repo</environment_context>"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "**Listing**"}],
             "content": [{"type": "reasoning_text", "text": "I will run ls."}], "encrypted_content": None},
            {"type": "function_call", "id": "fc_1", "call_id": "call_A", "name": "shell",
             "arguments": "{\"command\":[\"ls\",\"-la\"],\"workdir\":\"/repo\"}"},
            {"type": "function_call_output", "call_id": "call_A", "output": "total 8\nREADME.md\nsrc"},
            {"type": "web_search_call", "id": "ws_1", "status": "completed"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "README.md and src."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Thanks"}]},
        ],
    }


def openai_request() -> dict:
    return {
        "model": "local", "reasoning_effort": "none",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "developer", "content": [{"type": "text", "text": "Prefer tools."}]},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich"}, {"type": "text", "text": "and Paris?"}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\"}"}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"unit\": \"c\"}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "12°C"},
            {"role": "tool", "tool_call_id": "c2", "content": [{"type": "text", "text": "18°C"}]},
            {"role": "system", "content": "Answer in one line."},
            {"role": "user", "content": "Summarize."},
        ],
        "tools": [TOOLS[5], {"type": "custom", "custom": {"name": "grammar_tool"}}],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }


# --- OpenAI chat ----------------------------------------------------------------------------------

def test_openai_chat_becomes_the_canonical_conversation() -> None:
    conv = from_openai_chat(openai_request())
    assert conv.messages == [
        {"role": "system", "content": "You are terse.\n\nPrefer tools."},
        {"role": "user", "content": "Weather in Zürich\nand Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}}]},
        {"role": "tool", "content": "12°C", "tool_call_id": "c1", "name": "get_weather"},
        {"role": "tool", "content": "18°C\n<system-reminder>\nAnswer in one line.\n</system-reminder>",
         "tool_call_id": "c2", "name": "get_weather"},
        {"role": "user", "content": "Summarize."}]
    assert conv.tools == [TOOLS[5]]
    assert conv.tool_choice == {"name": "get_weather"}
    assert conv.template_kwargs == {"enable_thinking": False}


def test_openai_chat_details() -> None:
    base = [{"role": "user", "content": "hi"}]
    conv = from_openai_chat({"messages": base + [
        {"role": "assistant", "content": [{"type": "text", "text": "ok"}, {"type": "refusal", "refusal": "no"}],
         "reasoning_content": "why", "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "x", "name": "explicit", "content": "r"}]})
    assert conv.messages[1] == {"role": "assistant", "content": "ok\nno", "reasoning_content": "why",
                                "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": {}}}]}
    assert conv.messages[2]["name"] == "explicit"
    assert conv.tools is None and conv.tool_choice == "none" and conv.template_kwargs == {}
    conv = from_openai_chat({"messages": base, "chat_template_kwargs": {"enable_thinking": True, "x": 1},
                             "reasoning_effort": "none", "tools": [TOOLS[0]], "tool_choice": "required"})
    assert conv.template_kwargs == {"enable_thinking": True, "x": 1}  # the explicit kwargs win
    assert conv.tool_choice == "required"
    assert from_openai_chat({"messages": base, "tools": [TOOLS[0]]}).tool_choice == "auto"
    assert from_openai_chat({"messages": base, "tool_choice": "auto"}).tool_choice == "none"
    assert from_openai_chat({"messages": base, "reasoning_effort": "high"}).template_kwargs == {}


@pytest.mark.parametrize("body,param,words", [
    ([], "body", "must be an object"),
    ({}, "messages", "'messages' is required"),
    ({"messages": []}, "messages", "at least one"),
    ({"messages": "hi"}, "messages", "must be an array"),
    ({"messages": ["hi"]}, "messages[0]", "must be an object"),
    ({"messages": [{"content": "hi"}]}, "messages[0].role", "must be a string"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "unknown role"),
    ({"messages": [{"role": "function", "name": "f", "content": "x"}]}, "messages[0].role", "role 'tool'"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "must be an array"),
    ({"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}, "messages[0].content[0].type",
     "unsupported content part type 'video_url'"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]}, "messages[0].content[0].text", "string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "{\"a\": 1"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "must be a JSON object, got array"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name", "must be a string"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"type": "custom", "custom": {}}]}]},
     "messages[0].tool_calls[0].type", "only 'function'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "'tool_call_id' is required"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": {"a": 1}}, "tools", "must be an array"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": ""}}]},
     "tools[0].function.name", "must not be empty"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
     "tools[0].function.parameters", "must be an object"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice", "needs at least one"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"}, "tool_choice", "'auto', 'none', 'required'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOLS[0]],
      "tool_choice": {"type": "function", "function": {"name": "bash"}}}, "tool_choice", "'bash', which is not"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [TOOLS[0]], "tool_choice": {"type": "allowed_tools"}},
     "tool_choice.type", "only function tools"),
    ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": "x"}, "chat_template_kwargs", "object"),
])
def test_openai_chat_errors_name_the_field(body, param: str, words: str) -> None:
    with pytest.raises(RequestError) as e:
        from_openai_chat(body)
    assert e.value.param == param and words in e.value.message, (e.value.param, e.value.message)
    assert str(e.value) == f"{param}: {e.value.message}" and "\n" not in str(e.value)


# --- Responses ------------------------------------------------------------------------------------

def test_codex_responses_request_becomes_the_canonical_conversation() -> None:
    conv = from_responses(codex_request())
    assert conv.messages == [
        {"role": "system", "content": "You are Codex, a coding agent.\n\n<permissions>sandboxed</permissions>"},
        {"role": "user", "content": "<environment_context>cwd=/repo</environment_context>"},
        {"role": "user", "content": "List the files."},
        {"role": "assistant", "content": "", "reasoning_content": "I will run ls.", "tool_calls": [
            {"id": "call_A", "type": "function",
             "function": {"name": "shell", "arguments": {"command": ["ls", "-la"], "workdir": "/repo"}}}]},
        {"role": "tool", "content": "total 8\nREADME.md\nsrc", "tool_call_id": "call_A", "name": "shell"},
        {"role": "assistant", "content": "README.md and src."},
        {"role": "user", "content": "Thanks"}]
    assert [t["function"]["name"] for t in conv.tools] == ["shell"]  # web_search, custom, local_shell skipped
    assert conv.tools[0]["function"] == {"name": "shell", "description": "Runs a shell command",
                                         "parameters": codex_request()["tools"][0]["parameters"]}
    assert conv.tool_choice == "auto" and conv.template_kwargs == {}


def test_responses_details() -> None:
    conv = from_responses({"input": "hi", "reasoning": {"effort": "none"},
                           "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"}})
    assert conv.messages == [{"role": "user", "content": "hi"}]
    assert conv.template_kwargs == {"enable_thinking": False} and conv.tool_choice == {"name": "f"}
    conv = from_responses({"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "a"}, {"type": "summary_text", "text": "b"}]},
        {"type": "message", "role": "assistant", "content": "first"},
        {"type": "reasoning", "summary": [], "encrypted_content": "gAAA"},
        {"type": "function_call", "call_id": "k", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "m", "name": "g", "arguments": "{\"x\": [1]}"},
        {"type": "function_call_output", "call_id": "m", "output": [{"type": "input_text", "text": "done"}]},
        {"type": "function_call_output", "call_id": "k", "output": "ok"}]})
    assert conv.messages[1] == {"role": "assistant", "content": "first", "reasoning_content": "a\n\nb", "tool_calls": [
        {"id": "k", "type": "function", "function": {"name": "f", "arguments": {}}},
        {"id": "m", "type": "function", "function": {"name": "g", "arguments": {"x": [1]}}}]}
    assert conv.messages[2:] == [{"role": "tool", "content": "done", "tool_call_id": "m", "name": "g"},
                                 {"role": "tool", "content": "ok", "tool_call_id": "k", "name": "f"}]


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "stateless"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "stateless"),
    ({}, "input", "'input' is required"),
    ({"input": 3}, "input", "must be an array"),
    ({"input": "x", "instructions": ["a"]}, "instructions", "must be a string"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type", "stateless"),
    ({"input": [{"type": "telepathy"}]}, "input[0].type", "unknown input item type"),
    ({"input": [{"role": "user", "content": [{"type": "input_video"}]}]}, "input[0].content[0].type",
     "unsupported content part type"),
    ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role", "unknown role"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops}"}]}, "input[0].arguments",
     "not valid JSON"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id", "'call_id' is required"),
    ({"input": "x", "tools": [{"type": "function", "name": 5}]}, "tools[0].name", "must be a string"),
    ({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice.type",
     "only function tools"),
    ({"input": "x", "reasoning": "none"}, "reasoning", "must be an object"),
])
def test_responses_errors_name_the_field(body, param: str, words: str) -> None:
    with pytest.raises(RequestError) as e:
        from_responses(body)
    assert e.value.param == param and words in e.value.message, (e.value.param, e.value.message)


# --- Anthropic ------------------------------------------------------------------------------------

def test_claude_code_request_becomes_the_canonical_conversation() -> None:
    conv = from_anthropic(claude_code_request())
    assert conv.messages == [
        {"role": "system", "content": "You are Claude Code, Anthropic's official CLI for Claude.\n\n"
                                      "You are an interactive CLI tool that helps users with software engineering tasks."},
        {"role": "user", "content": "<system-reminder>\nContext.\n</system-reminder>\nWhy does test_parse fail?"},
        {"role": "assistant", "content": "Let me read the test.", "reasoning_content": "Read the test first.", "tool_calls": [
            {"id": "toolu_01", "type": "function", "function": {"name": "Read", "arguments": {"file_path": "/src/test_parse.py", "limit": 50}}},
            {"id": "toolu_02", "type": "function", "function": {"name": "Bash", "arguments": {"command": "pytest -q -k parse"}}}]},
        {"role": "tool", "content": "def test_parse():\n    assert parse('{}') == {}", "tool_call_id": "toolu_01", "name": "Read"},
        {"role": "tool", "content": "Error: 1 failed\nE  KeyError: 'a'", "tool_call_id": "toolu_02", "name": "Bash"},
        {"role": "user", "content": "Go on."},
        {"role": "assistant", "content": "The parser drops empty objects."},
        {"role": "user", "content": "Fix it."}]
    assert [t["function"]["name"] for t in conv.tools] == ["Read", "Bash"]
    assert conv.tools[0]["function"]["parameters"]["required"] == ["file_path"]
    assert conv.tool_choice == "auto" and conv.template_kwargs == {"enable_thinking": True}


def test_anthropic_details() -> None:
    user = [{"role": "user", "content": "hi"}]
    conv = from_anthropic({"messages": user, "system": "x-anthropic-billing-header: cch=1;\nBe brief.",
                           "thinking": {"type": "disabled"}, "tools": [{"name": "t", "input_schema": {"type": "object"}}],
                           "tool_choice": {"type": "any"}})
    assert conv.messages[0] == {"role": "system", "content": "Be brief."}
    assert conv.template_kwargs == {"enable_thinking": False} and conv.tool_choice == "required"
    assert from_anthropic({"messages": user, "tools": [{"name": "t", "input_schema": {}}],
                           "tool_choice": {"type": "tool", "name": "t"}}).tool_choice == {"name": "t"}
    assert from_anthropic({"messages": user, "tool_choice": {"type": "none"}}).tool_choice == "none"
    # only a leading billing block is dropped
    conv = from_anthropic({"messages": user, "system": [{"type": "text", "text": "A"},
                                                        {"type": "text", "text": "x-anthropic-billing-header: z"}]})
    assert conv.messages[0]["content"] == "A\n\nx-anthropic-billing-header: z"
    assert from_anthropic({"messages": user, "system": [{"type": "text", "text": "x-anthropic-billing-header: z"}]}).messages == [
        {"role": "user", "content": "hi"}]
    # a turn of only tool results, one whose error has no text, and an empty assistant turn
    conv = from_anthropic({"messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "t", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "is_error": True}]},
        {"role": "assistant", "content": []}]})
    assert conv.messages[2:] == [{"role": "tool", "content": "Error", "tool_call_id": "a", "name": "t"},
                                 {"role": "assistant", "content": ""}]


@pytest.mark.parametrize("body,param,words", [
    ({"messages": []}, "messages", "at least one"),
    ({"max_tokens": 5}, "messages", "'messages' is required"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role", 'Unexpected role "tool"'),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "'content' is required"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                 "content": [{"type": "search_result"}]}]}]},
     "messages[0].content[0].content[0].type", "unsupported content part type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "must be a string"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "t", "input": "x"}]}]},
     "messages[0].content[0].input", "must be an object"),
    ({"messages": [{"role": "assistant", "content": [{"type": "server_tool_use", "id": "s"}]}]},
     "messages[0].content[0].type", "unsupported content part type"),
    ({"messages": [{"role": "user", "content": "x"}], "system": [{"type": "table"}]}, "system[0].type", "unsupported"),
    ({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": 5}]}, "messages[1].content",
     "must be an array"),
    ({"messages": [{"role": "user", "content": "x"}], "system": 5}, "system", "must be an array"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice", "needs at least one"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "t", "input_schema": {}}],
      "tool_choice": {"type": "tool", "name": "u"}}, "tool_choice", "'u', which is not"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "sometimes"}}, "tool_choice.type", "'auto', 'any'"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"input_schema": {}}]}, "tools[0].name", "must be a string"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "maybe"}}, "thinking.type", "'enabled'"),
])
def test_anthropic_errors_name_the_field(body, param: str, words: str) -> None:
    with pytest.raises(RequestError) as e:
        from_anthropic(body)
    assert e.value.param == param and words in e.value.message, (e.value.param, e.value.message)


# --- what a text-only model cannot read --------------------------------------------------------------

def test_images_and_documents_become_placeholders_on_every_route() -> None:
    image = "[image omitted: this model reads text only]"
    document = "[document omitted: this model reads text only]"
    png = {"type": "base64", "media_type": "image/png", "data": "iVBOR"}
    conv = from_anthropic({"messages": [
        {"role": "user", "content": [{"type": "text", "text": "see"}, {"type": "image", "source": png},
                                     {"type": "document", "source": {"type": "text", "data": "x"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "Read", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                      "content": [{"type": "text", "text": "a.png:"}, {"type": "image", "source": png}]}]}]})
    assert conv.messages[0]["content"] == f"see\n{image}\n{document}"
    assert conv.messages[2]["content"] == f"a.png:\n{image}" and conv.omitted == {"image": 2, "document": 1}
    conv = from_openai_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:"}}, {"type": "file", "file": {}},
        {"type": "input_audio", "input_audio": {}}]}]})
    assert conv.messages == [{"role": "user", "content": f"a\n{image}\n{document}\n"
                                                         "[audio omitted: this model reads text only]"}]
    assert conv.omitted == {"image": 1, "document": 1, "audio": 1}
    conv = from_responses({"input": [
        {"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}, {"type": "input_file", "file_id": "f"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": [{"type": "input_image", "image_url": "data:"}]}]})
    assert conv.messages[0]["content"] == f"{image}\n{document}" and conv.messages[2]["content"] == image
    assert conv.omitted == {"image": 2, "document": 1}
    assert from_openai_chat({"messages": [{"role": "user", "content": "plain"}]}).omitted == {}


# --- through the chat templates -------------------------------------------------------------------

REQUESTS = {"anthropic": lambda: from_anthropic(claude_code_request()),
            "responses": lambda: from_responses(codex_request()),
            "openai": lambda: from_openai_chat(openai_request())}


@pytest.mark.parametrize("dialect", list(REQUESTS))
@pytest.mark.parametrize("key", list(TEMPLATES))
def test_every_dialect_renders_through_every_template(dialect: str, key: str) -> None:
    conv = REQUESTS[dialect]()
    prompt = render(key, conv)
    syntax = TEMPLATES[key][1]
    for message in conv.messages:
        if message["role"] in ("user", "tool"):
            assert message["content"] in prompt
        for call in message.get("tool_calls", []):
            name, args = call["function"]["name"], call["function"]["arguments"]
            key_, value = next(iter(args.items()))
            shown = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
            if syntax is ToolSyntax.QWEN_XML:
                assert f"<function={name}>\n<parameter={key_}>\n{shown}\n</parameter>\n" in prompt
            elif syntax is ToolSyntax.LAGUNA:
                assert f"<tool_call>{name}" in prompt and f"<arg_key>{key_}</arg_key>" in prompt
                assert f"<arg_value>{shown}</arg_value>" in prompt
            else:
                assert f'{{"name": "{name}", "arguments": {json.dumps(args, ensure_ascii=False)}}}' in prompt
    assert conv.messages[0]["content"] in prompt  # the one system message, with its parts merged
    assert "x-anthropic-billing-header" not in prompt


def test_a_later_system_message_stays_where_it_stands_and_qwen35_renders_it() -> None:
    """Qwen3.5/3.6 templates raise on a system message after the first; a later one is a
    ``<system-reminder>`` in the neighbouring user turn, on every route, and the first one alone
    is the template's system prompt."""
    raw = [{"role": "system", "content": "a"}, {"role": "user", "content": "hi"}, {"role": "system", "content": "b"}]
    keys = ["qwen3.5-shaped"] + (["qwen3.5"] if real_templates() else [])
    anthropic = {"system": "a", "messages": [{"role": "user", "content": "hi"},
                                             {"role": "system", "content": [{"type": "text", "text": "b"}]}]}
    responses = {"instructions": "a", "input": [{"role": "user", "content": "hi"}, {"role": "developer", "content": "b"}]}
    for key in keys:
        with pytest.raises(SparkpackError, match="System message must be at the beginning"):
            template(key).render(raw)
        for conv in (from_openai_chat({"messages": raw}), from_anthropic(anthropic), from_responses(responses)):
            assert conv.messages == [{"role": "system", "content": "a"},
                                     {"role": "user", "content": "hi\n<system-reminder>\nb\n</system-reminder>"}]
            assert render(key, conv).index("a") < render(key, conv).index("hi\n<system-reminder>\nb\n")


def test_where_a_later_system_message_goes() -> None:
    sysm = {"role": "system", "content": "s"}
    reminder = "<system-reminder>\ns\n</system-reminder>"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    chat = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c", "content": "r"}, {"role": "assistant", "content": "a"}]
    # leading ones merge (developer too), in order; after a tool result, at its end
    conv = from_openai_chat({"messages": [sysm, {"role": "developer", "content": "d"}, *chat[:3], sysm]})
    assert conv.messages[0] == {"role": "system", "content": "s\n\nd"}
    assert conv.messages[-1]["content"] == "r\n" + reminder
    # after an assistant message: opening the next user message, else a user message of its own
    conv = from_openai_chat({"messages": [*chat, sysm, sysm, {"role": "user", "content": "next"}]})
    assert conv.messages[-1] == {"role": "user", "content": f"{reminder}\n{reminder}\nnext"}
    assert from_openai_chat({"messages": [*chat, sysm]}).messages[-1] == {"role": "user", "content": reminder}
    conv = from_openai_chat({"messages": [*chat, sysm, {"role": "assistant", "content": "b"}]})
    assert conv.messages[-2:] == [{"role": "user", "content": reminder}, {"role": "assistant", "content": "b"}]
    # Anthropic: after a turn of tool results (and its text), and its top-level system first
    conv = from_anthropic({"system": "top", "messages": [
        {"role": "system", "content": "lead"}, {"role": "user", "content": "u"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "c", "name": "f", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r"}]}, sysm,
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c", "content": "r"},
                                     {"type": "text", "text": "go on"}]}, sysm]})
    assert conv.messages[0] == {"role": "system", "content": "top\n\nlead"}
    assert conv.messages[3]["content"] == "r\n" + reminder and conv.messages[-1]["content"] == "go on\n" + reminder


# conversations that grow turn by turn, as agents send them, with system messages on the way
GROWING = {
    "anthropic": (from_anthropic, {"system": "You code."}, "messages", [
        [{"role": "user", "content": "Fix the bug."}, {"role": "system", "content": "Env: linux."}],
        [{"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "read_file", "input": {"path": "a"}}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "x = 1"}]},
         {"role": "system", "content": [{"type": "text", "text": "Agent tool available."}]}],
        [{"role": "assistant", "content": [{"type": "text", "text": "Done."}]},
         {"role": "user", "content": "Thanks, now test it."}, {"role": "system", "content": "Compacted."}],
        [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}]]),
    "openai": (from_openai_chat, {}, "messages", [
        [{"role": "system", "content": "You code."}, {"role": "user", "content": "Fix the bug."},
         {"role": "developer", "content": "Env: linux."}],
        [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "a"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "x = 1"}, {"role": "system", "content": "Be brief."}],
        [{"role": "assistant", "content": "Done."}, {"role": "system", "content": "Tests exist."},
         {"role": "user", "content": "Thanks, now test it."}],
        [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "bye"}, {"role": "system", "content": "Bye."}]]),
    "responses": (from_responses, {"instructions": "You code."}, "input", [
        [{"role": "user", "content": "Fix the bug."}, {"role": "developer", "content": "Env: linux."}],
        [{"type": "function_call", "call_id": "c1", "name": "read_file", "arguments": '{"path": "a"}'},
         {"type": "function_call_output", "call_id": "c1", "output": "x = 1"},
         {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]}],
        [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Thanks, now test it."}]]),
}


@pytest.mark.parametrize("dialect", list(GROWING))
@pytest.mark.parametrize("key", list(TEMPLATES))
def test_a_later_system_message_keeps_the_prompt_before_it(dialect: str, key: str) -> None:
    """Each request's prompt repeats the previous one through its last reminder (the reuse a
    server gets) wherever the same conversation without the later system messages repeats itself
    (after a new user query Qwen's templates drop earlier turns' reasoning, reminders or not), and
    the text before a reminder is that of the conversation without it."""
    convert, base, field, turns = GROWING[dialect]
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}}}}]
    if dialect == "anthropic":
        tools = [{"name": "read_file", "input_schema": tools[0]["function"]["parameters"]}]
    elif dialect == "responses":
        tools = [{"type": "function", **tools[0]["function"]}]

    def prompt_of(messages: list[dict], generation: bool = True) -> str:
        return render(key, convert({**base, field: messages, "tools": tools}), add_generation_prompt=generation)

    def plain(messages: list[dict]) -> list[dict]:  # the conversation without its later system messages
        return [m for i, m in enumerate(messages) if i == 0 or m.get("role") not in ("system", "developer")]

    sent: list[dict] = []
    previous: tuple[str, int] | None = None
    compared = 0
    for turn in turns:
        before, sent = sent, sent + turn
        prompt = prompt_of(sent)
        if previous is not None and prompt_of(plain(sent)).startswith(prompt_of(plain(before), False)):
            text, through = previous
            assert prompt[:through] == text[:through], (key, dialect, len(sent))
            compared += 1
        previous = None
        last = sent[-1]
        if last.get("role") in ("system", "developer"):
            body = last["content"] if isinstance(last["content"], str) else last["content"][0]["text"]
            at = prompt.rindex(f"<system-reminder>\n{body}\n</system-reminder>")
            without = prompt_of(sent[:-1], False)
            common = next((i for i, (a, b) in enumerate(zip(prompt, without)) if a != b), len(without))
            # up to the newline that joins it to the message before, or all of that message
            assert common >= at - 1 or common == len(without), (key, dialect, prompt[common - 40:at + 40])
            previous = prompt, at + len(body)
    assert compared >= 1


def assistant_message(events: list) -> dict:
    """What the routes build from the parser's events (and clients send back next turn)."""
    content = "".join(e.text for e in events if isinstance(e, TextDelta))
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    starts = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    calls = [{"id": starts[e.index].id, "type": "function",
              "function": {"name": starts[e.index].name, "arguments": e.arguments}}
             for e in events if isinstance(e, ToolCallEnd)]
    message = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def parse(syntax: ToolSyntax, text: str, in_reasoning: bool) -> list:
    parser = OutputParser(syntax, in_reasoning=in_reasoning, parse_tools=True, tools=TOOLS)
    return parser.feed(text) + parser.finish()


def _round_trip_cases(key: str) -> list[Case]:
    syntax = TEMPLATES[key][1]
    cases = [c for c in CASES if c.syntax is syntax and c.calls]
    if key == "qwen3-coder":  # no reasoning in Qwen3-Coder's template
        cases = [c for c in cases if not c.reasoning]
    return cases


@pytest.mark.parametrize("key", list(TEMPLATES))
def test_parsed_calls_render_back_through_the_template_and_parse_the_same(key: str) -> None:
    """model text -> events -> canonical assistant message -> the model's own template -> the text
    a model would write -> events again: the same calls, reasoning and content."""
    tmpl = template(key)
    syntax, end = TEMPLATES[key][1], TEMPLATES[key][2]
    cases = _round_trip_cases(key)
    assert cases
    for case in cases:
        message = assistant_message(parse(case.syntax, case.text, case.in_reasoning))
        # the thinking mode that produced the message: Laguna's templates open the turn by it
        thinking = ({} if key.startswith("qwen") else {"enable_thinking": True} if key.startswith("synthetic")
                    else {"enable_thinking": "reasoning_content" in message})
        history = [{"role": "system", "content": "sys"}, {"role": "user", "content": "do it"}]
        prompt = tmpl.render(history, tools=TOOLS, **thinking)
        full = tmpl.render(history + [message], tools=TOOLS, add_generation_prompt=False, **thinking)
        assert full.startswith(prompt), (key, case.name, prompt[-40:], full[len(prompt) - 40:len(prompt) + 40])
        written = full[len(prompt):]
        assert written.endswith(end), (key, case.name, written[-60:])
        again = assistant_message(parse(syntax, written[:-len(end)], prompt_opens_reasoning(prompt)))
        want = dict(message)
        for call in want.get("tool_calls", []):  # ids are new each parse
            call["id"] = None
        for call in again.get("tool_calls", []):
            call["id"] = None
        assert again == want, (key, case.name, written)


# --- real data nobody here wrote (../shared/corpora) --------------------------------------------------

SHARED_CORPORA = Path(__file__).resolve().parents[1] / ".." / "shared" / "corpora" / "lucebox-hub"


def _corpus(name: str) -> Path:
    path = SHARED_CORPORA / name
    if not path.exists():
        pytest.skip(f"real-data file {path} is absent")
    return path


def test_real_agent_conversations_render_through_every_template() -> None:
    """bench_agent.jsonl: a coding agent's OpenAI-format requests on real SWE-bench issues."""
    rows = [json.loads(line) for line in _corpus("bench_agent.jsonl").read_text().splitlines() if line.strip()]
    assert rows
    keys = [k for k in TEMPLATES if k not in REAL or real_templates()]
    for row in rows:
        conv = from_openai_chat({"messages": row["messages"], "tools": TOOLS})
        texts = [m["content"] for m in row["messages"] if m["role"] not in ("system", "developer")]
        assert [m["content"] for m in conv.messages if m["role"] != "system"] == texts
        for key in keys:
            prompt = render(key, conv)
            assert all(t in prompt for t in texts), (row["id"], key)


def test_real_patches_as_call_arguments_survive_template_and_parser() -> None:
    """SWE-bench's reference patches (real diffs: braces, tags, quotes, tabs, unicode) as a tool
    call's argument: rendered by each template as the model would write it, then parsed back from
    random splits, they come out byte for byte."""
    import pyarrow.parquet as pq

    patches = pq.read_table(_corpus("swe_bench_verified.parquet"), columns=["patch"]).column("patch").to_pylist()
    patches = [p for p in patches[:: len(patches) // 60] if p][:60]
    tools = [{"type": "function", "function": {"name": "apply_patch", "parameters": {
        "type": "object", "properties": {"patch": {"type": "string"}, "strip": {"type": "integer"}}}}}]
    keys = [k for k in TEMPLATES if k not in REAL or real_templates()]
    rng = random.Random(0)
    for key in keys:
        tmpl, (_, syntax, end) = template(key), TEMPLATES[key]
        # a turn without reasoning: Laguna's templates open it with thinking off (ours with it on)
        kwargs = {} if key.startswith("qwen") else {"enable_thinking": key.startswith("synthetic")}
        history = [{"role": "user", "content": "Fix the issue."}]
        prompt = tmpl.render(history, tools=tools, **kwargs)
        for patch in patches:
            call = {"id": "c", "type": "function", "function": {"name": "apply_patch", "arguments": {"patch": patch, "strip": 1}}}
            full = tmpl.render(history + [{"role": "assistant", "content": "", "tool_calls": [call]}], tools=tools,
                               add_generation_prompt=False, **kwargs)
            assert full.startswith(prompt) and full.endswith(end), key
            written = full[len(prompt):-len(end)]
            cuts = sorted(rng.sample(range(1, len(written)), k=min(len(written) - 1, 40)))
            parser = OutputParser(syntax, in_reasoning=prompt_opens_reasoning(prompt), parse_tools=True, tools=tools)
            events = []
            for a, b in zip([0, *cuts], [*cuts, len(written)]):
                events += parser.feed(written[a:b])
            events += parser.finish()
            ends = [e for e in events if isinstance(e, ToolCallEnd)]
            assert [e.arguments for e in ends] == [{"patch": patch, "strip": 1}], (key, patch[:80])
