"""Constrained decoding: a JSON schema as a mask over the model's own vocabulary, step by step.

llguidance (Microsoft's grammar engine, the one llama.cpp can build with) compiles the schema
and walks it byte by byte; it is handed the GGUF vocabulary itself (``GGUFTokenizer``: every
token's bytes, byte-level stand-ins undone), so a mask allows exactly the tokens whose bytes keep
the text inside the grammar, and the end-of-turn token alone once the JSON is complete (one end
token: llguidance 1.6, the last release with a wheel for glibc 2.28, takes no list). Only
ordinary and byte tokens spell text: control and added tokens (``<|im_start|>``, ``<think>``,
``<tool_call>``, ``[PAD...]`` fillers) and unused ones are marked special, so none of them can
appear inside the JSON (their text still can, in ordinary tokens).

A mask needs the token chosen before it, so a constrained request decodes one token at a time
(``runtime.generate.continue_tokens``); unconstrained ones keep the one-step-ahead decode.
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import numpy as np
import torch

from .tokenizer import BYTE, NORMAL, GGUFTokenizer

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_SPECIAL = b"\xff"  # llguidance's mark of a special token (never text a grammar can match)


# JSON without free whitespace between its tokens (separators "," and ":", llguidance's): with
# whitespace allowed there, a model may add blanks until it runs out of tokens, a known failure of
# JSON-constrained decoding (the tiny test models do it at once). A schema's own "x-guidance"
# options come after.
_COMPACT = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema llguidance cannot compile (the request's fault): ``message`` is one line."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def _token_bytes(tokenizer: GGUFTokenizer, i: int) -> bytes:
    kind = tokenizer.token_types[i]
    text = tokenizer.tokens[i]
    if kind == BYTE and (m := _BYTE_TOKEN.fullmatch(text)):
        return bytes([int(m.group(1), 16)])
    if kind not in (NORMAL, BYTE):
        return _SPECIAL + text.encode("utf-8")
    return tokenizer.token_bytes(i)


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: the tokens' bytes, the end token and a
    tokenize function (it tokenizes only text it forces, which the server never asks for)."""

    def __init__(self, tokenizer: GGUFTokenizer, n_vocab: int):
        self._tokenizer = tokenizer
        self.tokens = [_token_bytes(tokenizer, i) for i in range(tokenizer.vocab_size)]
        self.tokens += [b""] * (n_vocab - len(self.tokens))  # rows of the output matrix past the vocabulary
        self.special_token_ids = [i for i, t in enumerate(self.tokens) if t.startswith(_SPECIAL)]
        self.eos_token_id = tokenizer.end_of_turn
        self.bos_token_id = tokenizer.bos_id

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # (the wrapper probes with bytes, then sends str)
            raise TypeError("text only")
        return self._tokenizer.encode(text)


class SchemaGrammars:
    """Compiles JSON schemas for one model: the llguidance tokenizer is built once, on first use
    (a pass over the vocabulary), and shared by every request's matcher."""

    def __init__(self, tokenizer: GGUFTokenizer, n_vocab: int):
        self._tokenizer, self._n_vocab = tokenizer, n_vocab
        self._ll = None
        self._lock = threading.Lock()

    def _lltokenizer(self):
        import llguidance

        with self._lock:
            if self._ll is None:
                wrapper = llguidance.TokenizerWrapper(_Vocabulary(self._tokenizer, self._n_vocab))
                self._ll = llguidance.LLTokenizer(wrapper, n_vocab=self._n_vocab)
            return self._ll

    def json_schema(self, schema: dict[str, Any]) -> "GrammarConstraint":
        """A fresh constraint for one reply; ``GrammarError`` when the schema does not compile."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=_COMPACT)
        except (ValueError, TypeError) as e:
            raise GrammarError(f"the JSON schema is not usable: {e}") from None
        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError("the JSON schema cannot be enforced: " + " ".join(matcher.get_error().split()))
        return GrammarConstraint(matcher, self._n_vocab)


class GrammarConstraint:
    """One reply's grammar state (``runtime.generate.TokenConstraint``): ``mask`` before each
    choice, ``accept`` after it."""

    def __init__(self, matcher, n_vocab: int):
        self._matcher = matcher
        self._n_vocab = n_vocab
        self._words = np.empty((n_vocab + 31) // 32, dtype=np.int32)  # one bit per token
        self._shifts: torch.Tensor | None = None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[n_vocab]`` with every token the grammar forbids next at -inf."""
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        if self._matcher.is_error():
            raise RuntimeError(f"grammar: {self._matcher.get_error()}")
        if self._shifts is None or self._shifts.device != logits.device:
            self._shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        words = torch.from_numpy(self._words).to(logits.device, non_blocking=False)
        allowed = ((words.unsqueeze(1) >> self._shifts) & 1).reshape(-1)[:logits.shape[-1]].bool()
        return logits.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past the chosen token; one the mask forbade is an error (a sampler that ignored it)."""
        if not self._matcher.consume_token(int(token)):
            raise RuntimeError(f"grammar: token {token} is not allowed here ({self._matcher.get_error()})")
