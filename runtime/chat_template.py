"""Render a model's ``tokenizer.chat_template`` exactly as transformers' ``apply_chat_template`` does.

The model was trained on what transformers renders, so the environment copies its choices: an
immutable sandbox (templates are untrusted code from the Hub), ``trim_blocks``/``lstrip_blocks``,
the ``loopcontrols`` extension, a ``tojson`` that does not HTML-escape and keeps non-ASCII text,
``raise_exception``, ``strftime_now``, and the special tokens as variables (``bos_token``...).
HF also drops message keys whose value is None and copies ``reasoning_content`` to ``thinking``.

Two normalisations go beyond HF, for OpenAI-style inputs that templates mishandle:
tool-call ``arguments`` given as a JSON string become a dict (newer Qwen templates iterate over
``arguments|items``; older ones ``tojson`` a dict), and content given as a list of only text parts
becomes one string (templates written for string content would print the list).
"""
from __future__ import annotations

import copy
import json
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from sparkpack.formats.errors import SparkpackError

if TYPE_CHECKING:
    from .tokenizer import GGUFTokenizer

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _GenerationTag])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise SparkpackError("tokenizer.chat_template",
                             f"template does not compile: {e.message} (line {e.lineno})") from None


def _generation_tag():
    """HF templates may wrap assistant text in ``{% generation %}``; it renders its body unchanged."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    return GenerationTag


_GenerationTag = _generation_tag()


def _normalise_tool_call(call: Any) -> Any:
    if not isinstance(call, dict):
        return call
    target = call["function"] if isinstance(call.get("function"), dict) else call
    args = target.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            target["arguments"] = parsed
    return call


def normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A deep copy of ``messages`` in the form templates expect (see the module docstring)."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise SparkpackError(None, f"chat message {i} must be a dict with a 'role', got {message!r:.80}")
        m = {k: copy.deepcopy(v) for k, v in message.items() if v is not None}
        content = m.get("content")
        if isinstance(content, list) and content and all(
                isinstance(p, dict) and p.get("type") == "text" for p in content):
            m["content"] = "".join(str(p.get("text", "")) for p in content)
        if isinstance(m.get("tool_calls"), list):
            m["tool_calls"] = [_normalise_tool_call(c) for c in m["tool_calls"]]
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """One compiled template plus the special-token strings it may reference."""

    def __init__(self, template: str, bos_token: str | None = None, eos_token: str | None = None,
                 **special_tokens: str | None):
        if not isinstance(template, str) or not template:
            raise SparkpackError("tokenizer.chat_template", "the chat template is empty")
        self.template = template
        self._compiled = _compile(template)
        self.special = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}

    @classmethod
    def from_tokenizer(cls, template: str, tokenizer: GGUFTokenizer) -> "ChatTemplate":
        """Special tokens named by a GGUFTokenizer's ids (the GGUF has no tokenizer_config.json)."""
        def text(i: int | None) -> str | None:
            return tokenizer.tokens[i] if i is not None else None

        return cls(template, bos_token=text(tokenizer.bos_id), eos_token=text(tokenizer.eos_id),
                   pad_token=text(tokenizer.pad_id))

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, **extra: Any) -> str:
        import jinja2

        context = {k: v for k, v in self.special.items() if v is not None}
        context.update(extra)
        try:
            return self._compiled.render(messages=normalise_messages(messages), tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **context)
        except jinja2.exceptions.TemplateError as e:
            raise SparkpackError("tokenizer.chat_template", f"template failed to render: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError) as e:
            raise SparkpackError("tokenizer.chat_template",
                                 f"template failed on these messages: {type(e).__name__}: {e}") from None


def render_chat(template: str, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                add_generation_prompt: bool = True, tokenizer: GGUFTokenizer | None = None, **extra: Any) -> str:
    """Render once; the compiled template is cached, so repeated calls are cheap. Pass the
    GGUFTokenizer as ``tokenizer`` so ``bos_token``/``eos_token`` have their values: templates
    such as Laguna's start with ``{{ bos_token }}``, which would otherwise render empty."""
    chat = ChatTemplate.from_tokenizer(template, tokenizer) if tokenizer is not None else ChatTemplate(template)
    return chat.render(messages, tools=tools, add_generation_prompt=add_generation_prompt, **extra)
