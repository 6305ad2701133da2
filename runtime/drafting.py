"""Drafters for speculative decoding: cheap guesses of the next tokens that one verify step of the
main model then keeps or drops (``runtime.speculative``). A draft changes speed, never the output:
the verify step computes the logits every drafted position would have had as a single decode step,
and only drafts the main model would have picked itself stand (sampling: see
``runtime.speculative.accept_sampled``).

The protocol a drafter follows (``Drafter``):

- ``name``: what ``--draft`` calls it (``ngram``, ``mtp``); the run's stats report it.
- ``needs_hidden``: whether ``propose`` reads the main model's hidden states. Then the loop runs
  every step as a verify call (which returns them) and collects the prompt's rows as it is fed.
- ``propose(tokens, k, hidden)``: up to ``k`` tokens that follow ``tokens`` (the whole sequence so
  far, prompt included, ending with the token just picked, which the main model has not been fed
  yet); fewer or none where it has no guess. ``hidden`` (only for ``needs_hidden``, else None):
  the main model's hidden rows ``[n_new, n_embd]`` of the positions fed since the previous
  ``propose`` and kept (rejected drafts' rows never arrive), in position order: row ``j`` is the
  position of ``tokens[len(tokens) - 1 - n_new + j]``. They are the output-normed rows, what
  ``MoEModel.forward_hidden`` returns and the MTP head reads (llama.cpp's ``h_nextn``); a drafter
  that wants the rows before the norm is told so by the lead, it is one line here
  (``Session.verify``). At the first call of a sequence they cover the whole prompt.
- ``rewind(n_tokens)``: the sequence now holds its first ``n_tokens`` tokens (the last picked
  token is not among them). Called after every verify with the kept length, and with a shorter
  one when a new request starts the sequence over at a shared prefix. A drafter that keeps state
  of its own (the MTP head's KV cache) drops what lies past it; stateless ones do nothing.

``NgramDrafter`` is the prompt-lookup drafter (``runtime.ngram_draft``'s index behind the
protocol). ``DraftLength`` is the rule that adapts ``k`` to the measured acceptance;
``DraftStats`` counts what the stats and ``/metrics`` report. (``bench/forced_drafter.py``, for
tests and benchmarks only, proposes the main model's own tokens with a set probability.)
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .ngram_draft import NgramIndex


class Drafter(Protocol):
    name: str
    needs_hidden: bool

    def propose(self, tokens: Sequence[int], k: int, hidden: torch.Tensor | None) -> list[int]: ...

    def rewind(self, n_tokens: int) -> None: ...


class NgramDrafter:
    """Prompt lookup: the tokens that followed the longest earlier match of the sequence's last
    ``max_ngram`` .. ``min_ngram`` tokens (at its latest occurrence). The index holds only the
    sequence's kept tokens: ``propose`` extends it with the tokens it has not seen, and starts it
    over when ``tokens`` no longer begin with them (a new request on the session)."""

    name = "ngram"
    needs_hidden = False

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.index = NgramIndex(max_ngram, min_ngram)

    def propose(self, tokens: Sequence[int], k: int, hidden: torch.Tensor | None = None) -> list[int]:
        seen = self.index.ids
        if len(tokens) < len(seen) or (seen and (tokens[len(seen) - 1] != seen[-1] or tokens[0] != seen[0])):
            self.index.reset()
        self.index.extend(tokens[len(self.index.ids):])
        return self.index.propose(k)

    def rewind(self, n_tokens: int) -> None:
        """Nothing to drop: rejected drafts never enter the index, and a request that starts
        over is noticed by ``propose`` itself."""


@dataclass
class DraftStats:
    """Verify steps and draft tokens of a session (``spark-run`` stats, the server's ``/metrics``)."""

    verify_steps: int = 0
    drafted: int = 0
    accepted: int = 0
    k: int = 0  # the draft length the rule chose last

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    def as_json(self) -> dict:
        return {"verify_steps": self.verify_steps, "drafted": self.drafted, "accepted": self.accepted,
                "acceptance": self.acceptance, "k": self.k,
                "tokens_per_verify": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps
                else None}


class DraftLength:
    """How many tokens to draft next: start at ``max_k``; a verify that kept every draft raises
    it by one (up to ``max_k``), one that kept less than half lowers it by one (down to 1).
    Why this rule: a verify step's cost grows with its rows (every extra row reads the weights'
    rows for it, and at partial residency its routings add misses), while a draft beyond the
    first rejected one is wasted, so the length follows the run of acceptances the drafter
    achieves; transformers' assisted generation adapts its length the same way (+2 / -1).
    A step with no draft says nothing about acceptance and leaves the length as it is."""

    def __init__(self, max_k: int):
        if max_k < 1:
            raise ValueError(f"the draft length must be at least 1, got {max_k}")
        self.max_k = max_k
        self.k = max_k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == drafted:
            self.k = min(self.max_k, self.k + 1)
        elif 2 * accepted < drafted:
            self.k = max(1, self.k - 1)
