"""Prompt-lookup drafting (``--draft ngram``: ``runtime.drafting.NgramDrafter``): guess the next
tokens by copying.

Coding agents re-emit what they have seen: file contents quoted back into an edit, paths, tool
arguments, identifiers. So when the last few tokens of the sequence (prompt and generated so far)
occurred before, the tokens that followed them then are a good guess for what follows now. No
weights, no model call: a draft costs a dictionary lookup, and a verify step of the main model
decides which of its tokens stand (a wrong draft costs speed, never a different output).

The match is the longest suffix of ``max_ngram`` down to ``min_ngram`` tokens that occurred
earlier, at its most recent earlier occurrence (recent context is the likelier one to repeat: the
file just read, the edit just made), as transformers' prompt lookup and llama.cpp's ngram drafts
do. The index maps every n-gram to where its latest earlier occurrence ended, updated as tokens
are appended, so proposing never scans the context: an agent prompt of 100k tokens costs no more
per step than a short one.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class NgramIndex:
    """The n-gram index of one sequence: ``extend`` it with every token the sequence takes (prompt,
    accepted drafts, the verify step's own token), ``propose`` before each verify step; ``reset``
    when the sequence starts over (a new conversation)."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram lengths must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.ids: list[int] = []
        # n-gram -> the position right after its latest occurrence whose continuation is known
        self._next: dict[tuple[int, ...], int] = {}

    def reset(self) -> None:
        self.ids.clear()
        self._next.clear()

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens. Each new token is the continuation of the n-grams that end just before
        it, which are then indexed (an n-gram ending at the last token has no continuation yet:
        it is what ``propose`` looks up)."""
        ids, index = self.ids, self._next
        for tok in tokens:
            end = len(ids)
            for n in range(self.min_ngram, self.max_ngram + 1):
                if n > end:
                    break
                index[tuple(ids[end - n:end])] = end
            ids.append(int(tok))

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the longest recent match of the sequence's suffix
        (fewer where the context ends first; none without a match)."""
        ids = self.ids
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, len(ids)), self.min_ngram - 1, -1):
            at = self._next.get(tuple(ids[len(ids) - n:]))
            if at is not None:
                return ids[at:at + k]
        return []


def accepted_prefix(draft: Sequence[int], target: Sequence[int]) -> int:
    """How many leading draft tokens a greedy verify keeps: the length of the common prefix."""
    n = 0
    for d, t in zip(draft, target):
        if d != t:
            break
        n += 1
    return n
