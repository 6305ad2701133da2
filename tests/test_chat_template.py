"""Chat rendering must give the very string transformers' apply_chat_template gives."""
from __future__ import annotations

import json

import pytest

from sparkpack.formats.errors import SparkpackError
from sparkpack.runtime.chat_template import ChatTemplate, render_chat
from tests.hf_tiny import build_tokenizer

# A Qwen3-style template: system + tool list, think blocks, tool calls, tool responses grouped in
# one user turn. Written in the shape of Qwen3's own template.
QWEN3_TEMPLATE = """
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call>:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- endif %}
        {%- if loop.last or reasoning_content %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city — °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello, who are you?"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
     {"role": "user", "content": "Ünïcödé 你好 😀?"}],
    [{"role": "system", "content": "Use tools."},
     {"role": "user", "content": "Weather in Paris and Zürich?"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
         {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "18°C, sunny"},
     {"role": "tool", "tool_call_id": "c2", "content": "12°C, rain"},
     {"role": "assistant", "content": "Paris 18°C, Zürich 12°C."},
     {"role": "user", "content": "Thanks"}],
]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("chat_tok")
    build_tokenizer("qwen3moe", d)
    return PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("gen", [False, True])
def test_identical_to_transformers(hf_tokenizer, i, with_tools, gen):
    messages = CONVERSATIONS[i]
    tools = [WEATHER_TOOL] if with_tools else None
    ref = hf_tokenizer.apply_chat_template(messages, tools=tools, chat_template=QWEN3_TEMPLATE, tokenize=False,
                                           add_generation_prompt=gen)
    ours = ChatTemplate(QWEN3_TEMPLATE, eos_token="<|im_end|>", pad_token="<|endoftext|>").render(
        messages, tools=tools, add_generation_prompt=gen)
    assert ours == ref


def test_expected_shape_of_a_tool_turn():
    out = render_chat(QWEN3_TEMPLATE, CONVERSATIONS[2], tools=[WEATHER_TOOL])
    assert out.startswith("<|im_start|>system\nUse tools.\n\n# Tools")
    assert '"description": "Current weather in a city — °C"' in out  # tojson keeps non-ASCII
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>' in out
    assert ("<|im_start|>user\n<tool_response>\n18°C, sunny\n</tool_response>\n<tool_response>\n12°C, rain\n"
            "</tool_response><|im_end|>\n") in out
    assert out.endswith("<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_string_arguments_and_text_parts_are_normalised():
    """OpenAI clients send arguments as a JSON string and content as text parts."""
    as_dicts = CONVERSATIONS[2]
    openai = json.loads(json.dumps(as_dicts))
    for call in openai[2]["tool_calls"]:
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"], separators=(",", ":"))
    openai[1]["content"] = [{"type": "text", "text": "Weather in Paris "}, {"type": "text", "text": "and Zürich?"}]
    openai[0]["name"] = None  # None-valued keys are dropped, as HF does
    assert render_chat(QWEN3_TEMPLATE, openai) == render_chat(QWEN3_TEMPLATE, as_dicts)
    assert isinstance(openai[2]["tool_calls"][0]["function"]["arguments"], str)  # caller's data untouched


def test_extra_variables_and_reasoning():
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(QWEN3_TEMPLATE, msgs, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    last = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "reasoning_content": "r\n"}]
    assert "<think>\nr\n</think>\n\na<|im_end|>" in render_chat(QWEN3_TEMPLATE, last, add_generation_prompt=False)


def test_hf_globals_are_available():
    tpl = ("{{ bos_token }}{% for m in messages %}{% if m.role == 'bad' %}{{ raise_exception('no bad roles') }}"
           "{% endif %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content | tojson(indent=1) }}{% endfor %}"
           "{{ strftime_now('%Y') | length }}")
    out = ChatTemplate(tpl, bos_token="<s>").render([{"role": "user", "content": {"a": "é"}}, {"role": "user"}])
    assert out == '<s>{\n "a": "é"\n}4'
    with pytest.raises(SparkpackError, match="no bad roles"):
        render_chat(tpl, [{"role": "bad", "content": "x"}])


@pytest.mark.parametrize("template,messages,message", [
    ("{% for m in messages %}{{ m.content }", [{"role": "user", "content": "x"}], "does not compile"),
    ("{{ messages[0].content.__class__.__mro__[1].__subclasses__() }}", [{"role": "user", "content": "x"}], "failed"),
    ("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}], "failed"),
    ("{{ messages }}", ["not a dict"], "must be a dict"),
    ("", [{"role": "user", "content": "x"}], "empty"),
])
def test_template_errors_are_user_errors(template, messages, message):
    with pytest.raises(SparkpackError, match=message):
        render_chat(template, messages)


def test_special_tokens_come_from_the_gguf_tokenizer(tmp_path):
    """Laguna-style templates open with {{ bos_token }}: with the tokenizer passed, the string
    equals transformers' (which reads it from tokenizer_config.json)."""
    from transformers import AutoTokenizer

    from sparkpack.runtime.tokenizer import GGUFTokenizer
    from tests.hf_tiny import tokenizer_metadata

    build_tokenizer("laguna", tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    tok = GGUFTokenizer.from_metadata(tokenizer_metadata(tmp_path, "laguna"))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ref = hf.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert ref.startswith("<|endoftext|>")
    assert render_chat(hf.chat_template, msgs, tokenizer=tok) == ref
    assert tok.encode(render_chat(hf.chat_template, msgs, tokenizer=tok)) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
