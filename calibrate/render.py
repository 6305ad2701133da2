"""Conversation -> the token ids the model sees when serving it, and which of them it generated.

Chats are rendered with the model's own chat template (from the GGUF metadata) and documents are
tokenised raw, so replay routes exactly the tokens a server would. Counts are kept per side because
decode speed depends on generated tokens: the assistant turns of a chat are generated-side, the
rest prompt-side.

Finding the assistant turns in the rendered text: a chat template is a black box, so each turn's
characters are found by rendering the conversation up to it (with the generation prompt, which ends
where the model starts writing) and through it, and taking the difference. Templates that render an
earlier turn differently once the conversation continues (Qwen3 drops old reasoning) break that
prefix property; the turn is then located by searching its rendered text, or its content, in the
full rendering. Character spans become token spans through the bytes each token stands for.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from sparkpack.formats.errors import SparkpackError

from .conversation import Conversation


class Tokenizer(Protocol):
    def encode(self, text: str, add_special: bool = ...) -> list[int]: ...

    def token_bytes(self, token_id: int) -> bytes: ...


# (messages, tools=None, add_generation_prompt=True) -> text: runtime.chat_template.ChatTemplate.render
RenderFn = Callable[..., str]


class RenderError(ValueError):
    """The template refused the conversation (e.g. a system message where it allows none)."""


@dataclass
class Rendered:
    ids: list[int]
    generated: np.ndarray  # bool [len(ids)]: True for tokens of assistant turns
    text: str


class ChatRenderer:
    """Renders conversations for one model: its template, its tokenizer."""

    def __init__(self, tokenizer: Tokenizer, render_template: RenderFn | None):
        self.tokenizer = tokenizer
        self._render = render_template

    def text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
             add_generation_prompt: bool) -> str:
        if self._render is None:
            raise RenderError("the model has no chat template (tokenizer.chat_template), so chats cannot be "
                              "rendered as served; give it documents or a model with a template")
        try:
            return self._render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        except RenderError:
            raise
        except SparkpackError as e:  # the template raised or failed on these messages
            raise RenderError(e.problem) from None

    def _maybe_text(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                    add_generation_prompt: bool) -> str | None:
        """A partial conversation's text, or None where the template refuses a prefix (some
        require a user message, or a final assistant turn); the caller then searches instead."""
        try:
            return self.text(messages, tools, add_generation_prompt)
        except RenderError:
            return None

    def render_or_reason(self, conv: Conversation) -> Rendered | str:
        """The conversation's tokens, or why it cannot be replayed (calibration and a server's
        bootstrap count the reasons alike)."""
        try:
            r = self.render(conv)
        except RenderError as e:
            return f"template refused: {str(e)[:80]}"
        return r if r.ids else "empty after rendering"

    def render(self, conv: Conversation) -> Rendered:
        if conv.kind == "document":
            ids = list(self.tokenizer.encode(conv.text or "", add_special=True))
            return Rendered(ids, np.zeros(len(ids), dtype=bool), conv.text or "")
        msgs, tools = conv.messages, conv.tools
        full = self.text(msgs, tools, conv.needs_generation_prompt)
        spans = self.generated_spans(msgs, tools, full)
        ids, gen = tokenize_with_spans(self.tokenizer, full, spans)
        return Rendered(ids, gen, full)

    def generated_spans(self, msgs: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        full: str) -> list[tuple[int, int]]:
        """Character spans of the assistant turns in ``full`` (see module docstring)."""
        spans: list[tuple[int, int]] = []
        cursor = 0
        for i, m in enumerate(msgs):
            if m.get("role") != "assistant":
                continue
            before = self._maybe_text(msgs[:i], tools, True) if i else None
            through = self._maybe_text(msgs[: i + 1], tools, False) or ""
            if before is not None and through.startswith(before) and full.startswith(through) \
                    and len(before) >= cursor:
                end = max(len(before), len(through.rstrip()))  # the newline after a turn is template's
                spans.append((len(before), end))
                cursor = end
                continue
            turn = through[len(before):] if before is not None and through.startswith(before) else ""
            found = _find(full, turn, cursor) or _find(full, str(m.get("content") or ""), cursor)
            if found is not None:
                spans.append(found)
                cursor = found[1]
        return spans


def _find(full: str, needle: str, start: int) -> tuple[int, int] | None:
    if not needle:
        return None
    pos = full.find(needle, start)
    return None if pos < 0 else (pos, pos + len(needle))


def tokenize_with_spans(tok: Tokenizer, text: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], np.ndarray]:
    """Tokens of ``text`` (template text: specials already in it) and a mask of those in ``spans``.

    Byte-level BPE is lossless, so each token's bytes tile the UTF-8 text: a token is on the
    generated side when its first byte lies in a span (a token straddling an edge goes with its start).
    """
    ids = list(tok.encode(text, add_special=False))
    gen = np.zeros(len(ids), dtype=bool)
    if not spans:
        return ids, gen
    lengths = np.array([len(tok.token_bytes(i)) for i in ids], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
    if int(lengths.sum()) != len(text.encode("utf-8")):
        raise RenderError("the tokenizer does not reproduce the rendered text byte for byte")
    for a, b in spans:
        ba, bb = len(text[:a].encode("utf-8")), len(text[:b].encode("utf-8"))
        gen |= (starts >= ba) & (starts < bb)
    return ids, gen
