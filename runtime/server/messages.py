"""Three request dialects (OpenAI chat, OpenAI Responses, Anthropic Messages) -> one conversation
that the model's own chat template renders.

The canonical form is what the real templates need, read in llama.cpp's ``models/templates``:
string content (Qwen3's template calls ``content.startswith``), tool-call arguments as a dict
(Qwen3.5/3.6 and Laguna iterate ``arguments|items``), the tool's name on tool results, reasoning as
``reasoning_content``, and at most one system message, first (Qwen3.5/3.6 raise "System message
must be at the beginning"). The system and developer messages that open the conversation are
merged into it; one later in the conversation stays where it stands, as a ``<system-reminder>``
block in the neighbouring user turn (``_place_systems``), so that adding one never changes the
tokens before it and prefix reuse keeps everything up to it.

Text parts of one message are joined with a newline, as llama.cpp joins them. The models read text
only: an image, a document, a file or audio becomes a short placeholder the model reads (so that a
conversation holding one goes on), counted in ``Conversation.omitted`` for the response header
and the log. Every ``RequestError`` names the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

BILLING_HEADER = "x-anthropic-billing-header:"


class RequestError(ValueError):
    """A request the server must answer with 400: ``param`` names the field (e.g.
    "messages[2].content"), ``message`` says the problem in one line, ``code`` is an OpenAI-style
    code or None."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"{param}: {message}" if param else message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class Conversation:
    """``messages``: {"role": "system"|"user"|"assistant"|"tool", "content": str}; an assistant may
    carry "reasoning_content" and "tool_calls" [{"id", "type": "function", "function": {"name",
    "arguments": dict}}]; a tool message "tool_call_id" and "name". ``tools`` in OpenAI
    function-tool form; ``tool_choice`` "auto" | "none" | "required" | {"name": str};
    ``template_kwargs`` go to the chat template (e.g. {"enable_thinking": False})."""
    messages: list[dict]
    tools: list[dict] | None
    tool_choice: str | dict
    template_kwargs: dict = field(default_factory=dict)
    omitted: dict[str, int] = field(default_factory=dict)  # placeholders put in, by kind ("image": 2)


# --- field access that names the field when it is wrong ----------------------------------------

def _type_name(value: Any) -> str:
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer", float: "number",
            type(None): "null"}.get(type(value), type(value).__name__)


def _object(value: Any, param: str | None) -> dict:
    if not isinstance(value, dict):
        raise RequestError(f"must be an object, got {_type_name(value)}", param or "body")
    return value


def _array(value: Any, param: str) -> list:
    if not isinstance(value, list):
        raise RequestError(f"must be an array, got {_type_name(value)}", param)
    return value


def _string(value: Any, param: str, *, empty: bool = True) -> str:
    if not isinstance(value, str):
        raise RequestError(f"must be a string, got {_type_name(value)}", param)
    if not empty and not value:
        raise RequestError("must not be empty", param)
    return value


def _optional_string(body: dict, key: str, param: str) -> str | None:
    value = body.get(key)
    return None if value is None else _string(value, param)


def _required(body: dict, key: str, param: str) -> Any:
    if body.get(key) is None:
        raise RequestError(f"'{key}' is required", param)
    return body[key]


# content part type -> what the placeholder calls it: the parts a text-only model cannot read
MEDIA_KINDS = {"image": "image", "image_url": "image", "input_image": "image",
               "document": "document", "file": "document", "input_file": "document",
               "audio": "audio", "input_audio": "audio"}


def placeholder(kind: str) -> str:
    """What the model reads instead of an image, a document or audio (README says so)."""
    return f"[{kind} omitted: this model reads text only]"


def _media_text(kind: Any, param: str, omitted: dict[str, int]) -> str:
    """The placeholder of a media part (counted in ``omitted``); any other unknown part is a 400."""
    if kind not in MEDIA_KINDS:
        raise RequestError(f"unsupported content part type {kind!r}", param)
    name = MEDIA_KINDS[kind]
    omitted[name] = omitted.get(name, 0) + 1
    return placeholder(name)


def _text_of(content: Any, param: str, text_types: dict[str, str], omitted: dict[str, int]) -> str:
    """A message's content as one string: a string, null, or parts whose type maps to the key
    holding their text (``text_types``); media parts become placeholders."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(_array(content, param)):
        pp = f"{param}[{j}]"
        part = _object(part, pp)
        kind = part.get("type")
        if kind in text_types:
            texts.append(_string(part.get(text_types[kind]), f"{pp}.{text_types[kind]}"))
        else:
            texts.append(_media_text(kind, f"{pp}.type", omitted))
    return "\n".join(texts)


def _arguments(value: Any, param: str) -> dict:
    """Tool-call arguments as the dict the templates iterate: OpenAI sends a JSON string."""
    if value is None:
        return {}
    if isinstance(value, dict):
        return value
    if not isinstance(value, str):
        raise RequestError(f"must be a JSON object or a string holding one, got {_type_name(value)}", param)
    if not value.strip():
        return {}
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise RequestError(f"is not valid JSON ({e.msg} at character {e.pos})", param) from None
    if not isinstance(parsed, dict):
        raise RequestError(f"must be a JSON object, got {_type_name(parsed)}", param)
    return parsed


def _tool_call(call_id: str, name: str, arguments: dict) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _function_tool(name: Any, description: Any, parameters: Any, param: str) -> dict:
    fn: dict[str, Any] = {"name": _string(name, f"{param}.name", empty=False)}
    if description is not None:
        fn["description"] = _string(description, f"{param}.description")
    if parameters is not None:
        fn["parameters"] = _object(parameters, f"{param}.parameters")
    return {"type": "function", "function": fn}


def system_reminder(text: str) -> str:
    """A mid-conversation system message as the model reads it: the block Claude Code itself
    writes into a user turn when a server refuses ``role: "system"`` in ``messages``."""
    return f"<system-reminder>\n{text}\n</system-reminder>"


def _joined(*texts: str) -> str:
    return "\n".join(t for t in texts if t)


def _place_systems(lead: list[str], messages: list[dict]) -> list[dict]:
    """One system message first (``lead``, then the system messages before any other, merged);
    each later one kept where it stands, as a ``system_reminder`` block:

    - after a user or tool message, at the end of that message (a tool result then reads like
      Claude Code's own reminders inside tool results; a new user message there would become the
      templates' "last query" and make Qwen's drop the reasoning of earlier turns, changing them);
    - after an assistant message (OpenAI clients put one before the next user message; Anthropic
      allows one only after a user turn), at the start of the next message if that is a user
      message, else (nothing follows yet, or an assistant or tool message) as a user message of
      its own (which Qwen's templates then treat as a new query, as they would the user's).

    Either way the tokens before it are those of the same conversation without it, and what the
    next turn appends (an assistant reply, a user message that the reminder then opens) extends
    the text: the next request's prompt repeats this one up to and through the reminder. (Putting
    it first in the next user message whenever one follows would move it there from the end of
    the previous one as soon as the next user turn arrives, and change the tokens before it.)"""
    lead = list(lead)
    out: list[dict] = []
    waiting: list[str] = []  # reminders after an assistant message, for the next message
    for m in messages:
        if m["role"] == "system":
            if not out:
                lead.append(m["content"])
            elif not waiting and out[-1]["role"] in ("user", "tool"):
                out[-1]["content"] = _joined(out[-1]["content"], system_reminder(m["content"]))
            else:
                waiting.append(system_reminder(m["content"]))
            continue
        if waiting:
            if m["role"] == "user":
                m = {**m, "content": _joined(*waiting, m["content"])}
            else:
                out.append({"role": "user", "content": _joined(*waiting)})
            waiting = []
        out.append(m)
    if waiting:
        out.append({"role": "user", "content": _joined(*waiting)})
    return ([{"role": "system", "content": "\n\n".join(lead)}] if lead else []) + out


def _check_choice(choice: str | dict, tools: list[dict] | None, param: str) -> str | dict:
    names = {t["function"]["name"] for t in tools or []}
    if isinstance(choice, dict):
        if choice["name"] not in names:
            raise RequestError(f"names tool {choice['name']!r}, which is not among the request's function tools",
                               param)
    elif choice == "required" and not names:
        raise RequestError("'required' needs at least one function tool in 'tools'", param)
    elif choice == "auto" and not names:
        return "none"
    return choice


def _openai_choice(value: Any, tools: list[dict] | None, param: str = "tool_choice") -> str | dict:
    """OpenAI chat: "auto" | "none" | "required" | {"type": "function", "function": {"name"}};
    Responses: {"type": "function", "name"}. Either form is accepted on both routes."""
    if value is None:
        return "auto" if tools else "none"
    if isinstance(value, str):
        if value not in ("auto", "none", "required"):
            raise RequestError(f"must be 'auto', 'none', 'required' or a function choice, got {value!r}", param)
        return _check_choice(value, tools, param)
    value = _object(value, param)
    if value.get("type") != "function":
        raise RequestError(f"forces tool type {value.get('type')!r}; only function tools run here", f"{param}.type")
    if isinstance(value.get("function"), dict):
        name = _string(value["function"].get("name"), f"{param}.function.name", empty=False)
    else:
        name = _string(value.get("name"), f"{param}.name", empty=False)
    return _check_choice({"name": name}, tools, param)


def _thinking_off_for(effort: Any, kwargs: dict) -> dict:
    """``reasoning_effort: "none"`` turns the template's thinking off unless the request's own
    chat_template_kwargs already say (llama.cpp maps it the same way)."""
    if effort == "none":
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def _template_kwargs(body: dict) -> dict:
    kwargs = body.get("chat_template_kwargs")
    return dict(_object(kwargs, "chat_template_kwargs")) if kwargs is not None else {}


# --- OpenAI chat completions -------------------------------------------------------------------

_CHAT_TEXT = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def from_openai_chat(body: dict) -> Conversation:
    """``/v1/chat/completions``."""
    body = _object(body, None)
    messages = _array(_required(body, "messages", "messages"), "messages")
    if not messages:
        raise RequestError("must hold at least one message", "messages")
    out: list[dict] = []
    names: dict[str, str] = {}
    omitted: dict[str, int] = {}
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        m = _object(m, p)
        role = _string(m.get("role"), f"{p}.role")
        content = _text_of(m.get("content"), f"{p}.content", _CHAT_TEXT, omitted)
        if role in ("system", "developer"):
            out.append({"role": "system", "content": content})
        elif role == "user":
            out.append({"role": "user", "content": content})
        elif role == "assistant":
            message = {"role": "assistant", "content": content}
            reasoning = m.get("reasoning_content", m.get("reasoning"))
            if reasoning is not None:
                message["reasoning_content"] = _string(reasoning, f"{p}.reasoning_content")
            calls = []
            for j, c in enumerate(_array(m.get("tool_calls") or [], f"{p}.tool_calls")):
                pc = f"{p}.tool_calls[{j}]"
                c = _object(c, pc)
                if c.get("type", "function") != "function":
                    raise RequestError(f"tool call type {c.get('type')!r} is not supported; only 'function'", f"{pc}.type")
                fn = _object(c.get("function"), f"{pc}.function")
                name = _string(fn.get("name"), f"{pc}.function.name", empty=False)
                call_id = _optional_string(c, "id", f"{pc}.id") or f"call_{i}_{j}"
                names[call_id] = name
                calls.append(_tool_call(call_id, name, _arguments(fn.get("arguments"), f"{pc}.function.arguments")))
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        elif role == "tool":
            call_id = _string(_required(m, "tool_call_id", f"{p}.tool_call_id"), f"{p}.tool_call_id")
            name = _optional_string(m, "name", f"{p}.name") or names.get(call_id, "")
            out.append({"role": "tool", "content": content, "tool_call_id": call_id, "name": name})
        elif role == "function":
            raise RequestError("role 'function' (deprecated) is not supported; send tool results with role 'tool'",
                               f"{p}.role")
        else:
            raise RequestError(f"unknown role {role!r}", f"{p}.role")
    tools = _function_tools(body.get("tools"), flat=False)
    return Conversation(messages=_place_systems([], out), tools=tools,
                        tool_choice=_openai_choice(body.get("tool_choice"), tools),
                        template_kwargs=_thinking_off_for(body.get("reasoning_effort"), _template_kwargs(body)),
                        omitted=omitted)


def _function_tools(value: Any, *, flat: bool) -> list[dict] | None:
    """Function tools (``flat``: Responses' form, without the ``function`` wrapper). Other kinds
    (custom, web search, MCP, local shell...) cannot be called by these models and are skipped."""
    if value is None:
        return None
    tools = []
    for k, t in enumerate(_array(value, "tools")):
        pt = f"tools[{k}]"
        t = _object(t, pt)
        if t.get("type", None if flat else "function") != "function":
            continue
        fn, pf = (t, pt) if flat else (_object(t.get("function"), f"{pt}.function"), f"{pt}.function")
        tools.append(_function_tool(fn.get("name"), fn.get("description"), fn.get("parameters"), pf))
    return tools or None


# --- OpenAI Responses ------------------------------------------------------------------------------

_RESPONSES_TEXT = {"input_text": "text", "output_text": "text", "text": "text", "refusal": "refusal"}
# items of tools this server does not run: their calls carry nothing a text model can continue from
_HOSTED_ITEMS = {"web_search_call", "file_search_call", "computer_call", "computer_call_output",
                 "image_generation_call", "code_interpreter_call", "local_shell_call", "local_shell_call_output",
                 "custom_tool_call", "custom_tool_call_output", "mcp_call", "mcp_list_tools",
                 "mcp_approval_request", "mcp_approval_response", "compaction"}


def from_responses(body: dict) -> Conversation:
    """``/v1/responses``, stateless: the whole conversation comes in ``input`` every time."""
    body = _object(body, None)
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RequestError(f"this server is stateless and stores no responses, so '{key}' cannot be used; "
                               "send the whole conversation in 'input' (Codex does with its default settings)", key)
    lead = [_string(body["instructions"], "instructions")] if body.get("instructions") is not None else []
    value = _required(body, "input", "input")
    items = [{"type": "message", "role": "user", "content": value}] if isinstance(value, str) else _array(value, "input")
    out: list[dict] = []
    names: dict[str, str] = {}
    omitted: dict[str, int] = {}
    reasoning: list[str] = []   # reasoning items wait for the assistant output they precede

    def assistant() -> dict:
        """The assistant message this item belongs to: the last one, unless a user or tool turn came since."""
        if not out or out[-1]["role"] != "assistant":
            out.append({"role": "assistant", "content": ""})
        message = out[-1]
        if reasoning:
            earlier = [message["reasoning_content"]] if "reasoning_content" in message else []
            message["reasoning_content"] = "\n\n".join(earlier + reasoning)
            reasoning.clear()
        return message

    for i, item in enumerate(items):
        p = f"input[{i}]"
        item = _object(item, p)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _string(item.get("role"), f"{p}.role")
            content = _text_of(item.get("content"), f"{p}.content", _RESPONSES_TEXT, omitted)
            if role in ("system", "developer"):
                out.append({"role": "system", "content": content})
            elif role == "user":
                out.append({"role": "user", "content": content})
            elif role == "assistant":
                message = assistant()
                message["content"] = "\n".join(x for x in (message["content"], content) if x)
            else:
                raise RequestError(f"unknown role {role!r}", f"{p}.role")
        elif kind == "function_call":
            call_id = _string(_required(item, "call_id", f"{p}.call_id"), f"{p}.call_id")
            name = _string(item.get("name"), f"{p}.name", empty=False)
            names[call_id] = name
            assistant().setdefault("tool_calls", []).append(
                _tool_call(call_id, name, _arguments(item.get("arguments"), f"{p}.arguments")))
        elif kind == "function_call_output":
            call_id = _string(_required(item, "call_id", f"{p}.call_id"), f"{p}.call_id")
            content = _text_of(item.get("output"), f"{p}.output", _RESPONSES_TEXT, omitted)
            out.append({"role": "tool", "content": content, "tool_call_id": call_id, "name": names.get(call_id, "")})
        elif kind == "reasoning":
            text = _reasoning_text(item, p)
            if text:
                reasoning.append(text)
        elif kind == "item_reference":
            raise RequestError("item references need stored responses; this server is stateless: send the item itself",
                               f"{p}.type")
        elif kind in _HOSTED_ITEMS:
            continue
        else:
            raise RequestError(f"unknown input item type {kind!r}", f"{p}.type")
    if reasoning and out and out[-1]["role"] == "assistant":
        assistant()
    tools = _function_tools(body.get("tools"), flat=True)
    effort = _object(body["reasoning"], "reasoning").get("effort") if body.get("reasoning") is not None else None
    return Conversation(messages=_place_systems(lead, out), tools=tools,
                        tool_choice=_openai_choice(body.get("tool_choice"), tools),
                        template_kwargs=_thinking_off_for(effort, _template_kwargs(body)), omitted=omitted)


def _reasoning_text(item: dict, p: str) -> str:
    """The reasoning's own text when the client kept it (``content``), else its summary."""
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        texts = []
        for j, part in enumerate(_array(item.get(key) or [], f"{p}.{key}")):
            part = _object(part, f"{p}.{key}[{j}]")
            if part.get("type", kind) == kind:
                texts.append(_string(part.get("text"), f"{p}.{key}[{j}].text"))
        if texts:
            return "\n\n".join(texts)
    return ""


# --- Anthropic messages ----------------------------------------------------------------------------

ANTHROPIC_ROLES = ("user", "assistant", "system")  # "system": Anthropic's mid-conversation system messages

def from_anthropic(body: dict) -> Conversation:
    """``/v1/messages`` and ``/v1/messages/count_tokens``."""
    body = _object(body, None)
    omitted: dict[str, int] = {}
    lead = _anthropic_system(body.get("system"), omitted)
    messages = _array(_required(body, "messages", "messages"), "messages")
    if not messages:
        raise RequestError("must hold at least one message", "messages")
    out: list[dict] = []
    names: dict[str, str] = {}
    for i, m in enumerate(messages):
        p = f"messages[{i}]"
        m = _object(m, p)
        role = _string(m.get("role"), f"{p}.role")
        if role not in ANTHROPIC_ROLES:
            raise RequestError(f'Unexpected role "{role}". The Messages API accepts "user", "assistant" and '
                               '"system" (mid-conversation) as an input message role', f"{p}.role")
        content = _required(m, "content", f"{p}.content")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else _array(content, f"{p}.content")
        if role == "assistant":
            out.append(_anthropic_assistant(blocks, f"{p}.content", names, omitted))
        elif role == "system":  # a mid-conversation system message (Claude Code sends them)
            out.append({"role": "system", "content": _text_of(blocks, f"{p}.content", {"text": "text"}, omitted)})
        else:
            out.extend(_anthropic_user(blocks, f"{p}.content", names, omitted))
    tools = _anthropic_tools(body.get("tools"))
    return Conversation(messages=_place_systems(lead, out), tools=tools,
                        tool_choice=_anthropic_choice(body.get("tool_choice"), tools),
                        template_kwargs=_anthropic_thinking(body), omitted=omitted)


def _anthropic_system(value: Any, omitted: dict[str, int]) -> list[str]:
    """Claude Code opens ``system`` with an ``x-anthropic-billing-header:`` block that changes every
    request and would defeat prefix reuse; it means nothing to the model, so it is dropped."""
    if value is None:
        return []
    if isinstance(value, str):
        if value.startswith(BILLING_HEADER):
            value = value.partition("\n")[2]
        return [value] if value else []
    blocks = _array(value, "system")
    texts = []
    for k, block in enumerate(blocks):
        pb = f"system[{k}]"
        block = _object(block, pb)
        if block.get("type") != "text":
            texts.append(_media_text(block.get("type"), f"{pb}.type", omitted))
            continue
        text = _string(block.get("text"), f"{pb}.text")
        if k == 0 and text.startswith(BILLING_HEADER):
            continue
        texts.append(text)
    return ["\n\n".join(texts)] if texts else []


def _anthropic_assistant(blocks: list, p: str, names: dict[str, str], omitted: dict[str, int]) -> dict:
    texts, thoughts, calls = [], [], []
    for j, block in enumerate(blocks):
        pb = f"{p}[{j}]"
        block = _object(block, pb)
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), f"{pb}.text"))
        elif kind == "thinking":
            thoughts.append(_string(block.get("thinking"), f"{pb}.thinking"))
        elif kind == "redacted_thinking":
            continue  # encrypted by Anthropic: nothing a local model can read
        elif kind == "tool_use":
            call_id = _string(block.get("id"), f"{pb}.id", empty=False)
            name = _string(block.get("name"), f"{pb}.name", empty=False)
            names[call_id] = name
            calls.append(_tool_call(call_id, name, _object(block.get("input", {}), f"{pb}.input")))
        else:
            texts.append(_media_text(kind, f"{pb}.type", omitted))
    message: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        message["reasoning_content"] = "\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return message


def _anthropic_user(blocks: list, p: str, names: dict[str, str], omitted: dict[str, int]) -> list[dict]:
    """Tool results become tool messages, ahead of the turn's text (they answer the calls just made)."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        pb = f"{p}[{j}]"
        block = _object(block, pb)
        kind = block.get("type")
        if kind == "text":
            texts.append(_string(block.get("text"), f"{pb}.text"))
        elif kind == "tool_result":
            call_id = _string(block.get("tool_use_id"), f"{pb}.tool_use_id", empty=False)
            content = _text_of(block.get("content"), f"{pb}.content", {"text": "text"}, omitted)
            if block.get("is_error") is True:
                content = "Error: " + content if content else "Error"
            results.append({"role": "tool", "content": content, "tool_call_id": call_id,
                            "name": names.get(call_id, "")})
        else:
            texts.append(_media_text(kind, f"{pb}.type", omitted))
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _anthropic_tools(value: Any) -> list[dict] | None:
    """Client tools with an ``input_schema``; Anthropic's typed tools (``web_search_20250305``,
    ``bash_20250124``...) have no schema a local model could follow and are skipped."""
    if value is None:
        return None
    tools = []
    for k, t in enumerate(_array(value, "tools")):
        pt = f"tools[{k}]"
        t = _object(t, pt)
        if t.get("type") not in (None, "custom"):
            continue
        tools.append(_function_tool(t.get("name"), t.get("description"), t.get("input_schema", {}), pt))
    return tools or None


def _anthropic_choice(value: Any, tools: list[dict] | None) -> str | dict:
    """{"type": "auto" | "any" | "tool" | "none", "name"}."""
    if value is None:
        return "auto" if tools else "none"
    value = _object(value, "tool_choice")
    kind = value.get("type")
    if kind == "tool":
        choice: str | dict = {"name": _string(value.get("name"), "tool_choice.name", empty=False)}
    elif kind in ("auto", "any", "none"):
        choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
    else:
        raise RequestError(f"must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")
    return _check_choice(choice, tools, "tool_choice")


def _anthropic_thinking(body: dict) -> dict:
    kwargs = _template_kwargs(body)
    if body.get("thinking") is not None:
        kind = _object(body["thinking"], "thinking").get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise RequestError(f"must be 'enabled', 'disabled' or 'adaptive', got {kind!r}", "thinking.type")
        kwargs.setdefault("enable_thinking", kind != "disabled")
    return kwargs


# --- structured outputs: the JSON schema a reply must match (None: free text) -----------------------

def _json_format(fmt: Any, param: str, schema_of: str | None, types: tuple[str, ...]) -> dict | None:
    """One dialect's format object: ``{"type": "text"}`` (free), ``json_object`` (any JSON
    object) or ``json_schema`` with its schema under ``schema_of`` (None: in the object itself)."""
    if fmt is None:
        return None
    fmt = _object(fmt, param)
    kind = fmt.get("type")
    if kind not in types:
        raise RequestError(f"must be {', '.join(repr(t) for t in types)}, got {kind!r}", f"{param}.type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    holder, where = fmt, param
    if schema_of is not None:
        holder, where = _object(_required(fmt, schema_of, f"{param}.{schema_of}"), f"{param}.{schema_of}"), \
            f"{param}.{schema_of}"
    schema = holder.get("schema")
    return {} if schema is None else _object(schema, f"{where}.schema")


def openai_chat_output_schema(body: dict) -> dict | None:
    """``response_format``: text, json_object or json_schema (``json_schema.schema``)."""
    return _json_format(body.get("response_format"), "response_format", "json_schema",
                        ("text", "json_object", "json_schema"))


def responses_output_schema(body: dict) -> dict | None:
    """``text.format``: text, json_object or json_schema (``schema`` beside ``name``)."""
    if body.get("text") is None:
        return None
    return _json_format(_object(body["text"], "text").get("format"), "text.format", None,
                        ("text", "json_object", "json_schema"))


def anthropic_output_schema(body: dict) -> dict | None:
    """``output_config.format`` (and its beta predecessor, top-level ``output_format``):
    ``{"type": "json_schema", "schema"}``."""
    if body.get("output_config") is not None:
        fmt = _object(body["output_config"], "output_config").get("format")
        if fmt is not None:
            return _json_format(fmt, "output_config.format", None, ("json_schema",))
    return _json_format(body.get("output_format"), "output_format", None, ("json_schema",))
