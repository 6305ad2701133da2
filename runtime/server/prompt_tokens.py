"""The tokens of a rendered prompt, reusing those of a recent prompt it repeats.

Why: an agent resends its whole conversation every turn, and tokenizing it is most of what the
server does before the prefill (rendering the template is much cheaper), and the time grows
with the conversation, while the
prefill of a turn (prefix reuse: ``runtime.generate.Session.prompt``) does not.

Exact, by how the tokenizer works (``GGUFTokenizer.encode_marked``): it splits the text at added
tokens, leftmost and longest match first, then tokenizes each piece between them alone. Take an
added token that starts at character ``b`` of a recent prompt, where the new prompt repeats that
one for at least ``b`` plus the longest added token's length: no match starting before ``b`` can
reach past what both share, so both texts have the same matches up to ``b`` and the same one at
``b``, the same pieces before it, and the split of the rest starts afresh at ``b``. The new
prompt's tokens are then the recent ones before that token followed by the tokens of its text
from ``b`` on.
"""
from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from ..prefix_reuse import shared_len
from ..tokenizer import GGUFTokenizer


@dataclass(frozen=True)
class _Tokenized:
    text: str
    ids: list[int]
    marks: list[tuple[int, int]]  # (character offset, index in ids) of each added token


class PromptTokens:
    """``encode(text)``: ``tokenizer.encode(text)`` (no BOS/EOS), reusing the longest usable part of
    one of the ``keep`` prompts encoded last (several agents may take turns)."""

    def __init__(self, tokenizer: GGUFTokenizer, keep: int = 8):
        self.tok = tokenizer
        self.keep = keep
        self.reach = tokenizer.longest_added
        self.recent: list[_Tokenized] = []  # most recent last
        self.reused = 0  # tokens the last encode took from a recent prompt
        self._lock = threading.Lock()  # (routes may tokenize in several threads)

    def encode(self, text: str) -> list[int]:
        with self._lock:
            recent = list(self.recent)
        best: tuple[int, int, int, _Tokenized] | None = None  # (offset, id index, mark index, prompt)
        for old in recent:
            limit = shared_len(text, old.text) - self.reach
            j = bisect.bisect_right(old.marks, (limit, len(old.ids))) - 1  # the last mark at or before limit
            if j >= 0 and old.marks[j][0] > 0 and (best is None or old.marks[j][0] > best[0]):
                best = (*old.marks[j], j, old)
        if best is None:
            ids, marks = self.tok.encode_marked(text)
            reused = 0
        else:
            at, k, j, old = best
            tail, tail_marks = self.tok.encode_marked(text[at:])
            ids = old.ids[:k] + tail
            marks = old.marks[:j] + [(o + at, i + k) for o, i in tail_marks]
            reused = k
        with self._lock:
            kept = [p for p in self.recent if p.text != text] + [_Tokenized(text, ids, marks)]
            self.recent = kept[-self.keep:]
            self.reused = reused
        return list(ids)
