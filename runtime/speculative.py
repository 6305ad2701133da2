"""Speculative decoding: a drafter guesses the next tokens (``runtime.drafting``), one verify step of
the main model (``Session.verify``) computes the logits of the picked token and of every draft at
once, and the tokens the main model would have picked itself are kept (``Session.keep`` rolls the
sequence back exactly to them), plus the one it picks after the last kept row.

Exact: row i of a verify step is bit for bit the single decode step after the i-th token
(``MoEModel.decode_run``), so a greedy run keeps a draft exactly when the plain run would have
picked it, and its tokens are the plain run's, token for token, at any residency. With sampling,
``runtime.sampling.Sampler.verify_draft`` keeps the sampled distribution (the rejection rule of
Leviathan et al.); the draws differ from a plain run's (they are not the same random numbers).

What a run gains: each verify step costs about one decode step (the weights are read once for
its rows, and at partial residency the union of its rows' missed experts once), and yields the
kept drafts plus one token. ``DraftLength`` sets how many to draft from the acceptance so far.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from sparkpack.formats.profile import SIDES

from .drafting import DraftLength, DraftStats, Drafter
from .ngram_draft import accepted_prefix

if TYPE_CHECKING:
    from .generate import Session, TokenSampler

GENERATED = SIDES[1]  # (``runtime.generate.GENERATED``: the side of generated tokens)


class Speculation:
    """A session's drafting (``Session.draft``): the drafter, its length rule and counts, and for a
    drafter that reads hidden states the rows not yet handed to it (``pending``: positions from
    ``pending_from`` on, in order; eager prompt calls append to it, ``MoEModel.hidden_out``)."""

    def __init__(self, drafter: Drafter, max_k: int):
        self.drafter = drafter
        self.length = DraftLength(max_k)
        self.stats = DraftStats(k=max_k)
        self.pending: list[torch.Tensor] = []
        self.pending_from = 0

    def rewind(self, n_tokens: int) -> None:
        """The sequence now holds its first ``n_tokens`` tokens: pending rows past them go, and
        the drafter drops its own state past them."""
        if n_tokens >= self.pending_from:
            rows = torch.cat(self.pending) if self.pending else None
            self.pending = [rows[: n_tokens - self.pending_from]] if rows is not None else []
        else:
            self.pending.clear()
            self.pending_from = n_tokens
        self.drafter.rewind(n_tokens)

    def hidden(self) -> torch.Tensor | None:
        """The pending rows for ``propose`` (None for a drafter that reads none), handed over once."""
        if not self.drafter.needs_hidden:
            return None
        rows = torch.cat(self.pending) if self.pending else None
        self.pending = []
        if rows is not None:
            self.pending_from += rows.shape[0]
        return rows

    def kept(self, hidden: torch.Tensor, k: int) -> None:
        """A verify step kept its first ``k`` rows (``hidden``: the step's rows)."""
        if self.drafter.needs_hidden:
            self.pending.append(hidden[:k])


def speculative_tokens(session: Session, logits: torch.Tensor, n: int, sampler: TokenSampler | None
                       ) -> Iterator[int]:
    """Up to ``n`` tokens after the fed ones (whose last logits are ``logits``), drafted by
    ``session.draft`` and verified. Each token is yielded once it is decided, so a consumer that
    stops at a stop token stops the drafting too; the session may then have fed tokens past it,
    as ``Session.decode`` does (a later ``feed`` keeps or recomputes them as usual). ``sampler``
    None: greedy (argmax); else its draws, the drafts judged by ``Sampler.verify_draft``."""
    spec = session.draft
    assert spec is not None
    seq = list(session.fed)

    def choose(row: torch.Tensor) -> int:
        return int(torch.argmax(row)) if sampler is None else int(sampler.sample(row, seq))

    if n <= 0:
        return
    tok = choose(logits)
    produced = 0
    while True:
        yield tok
        produced += 1
        seq.append(tok)
        if produced >= n:
            return
        # the kept drafts and the token after them must fit in the n
        k = min(spec.length.k, n - produced - 1)
        drafts = list(spec.drafter.propose(seq, k, spec.hidden()))[:k] if k > 0 else []
        if not drafts and not spec.drafter.needs_hidden:  # nothing to verify: a plain (captured) step
            tok = choose(session.feed(session.fed + [tok], GENERATED))
            continue
        rows, h = session.verify([tok] + drafts)
        if sampler is None:
            targets = torch.argmax(rows, dim=-1).tolist()  # (first index on ties, as a single step's)
            a = accepted_prefix(drafts, targets)
            nxt = targets[a]
        else:
            a, nxt = len(drafts), None
            for i, d in enumerate(drafts):
                other = sampler.verify_draft(rows[i], d, seq + drafts[:i])
                if other is not None:
                    a, nxt = i, other
                    break
            if nxt is None:  # every draft kept: the token after them
                nxt = int(sampler.sample(rows[a], seq + drafts))
        session.keep(a + 1)
        spec.kept(h, a + 1)
        spec.stats.verify_steps += 1
        spec.stats.drafted += len(drafts)
        spec.stats.accepted += a
        spec.length.update(len(drafts), a)
        spec.stats.k = spec.length.k
        for d in drafts[:a]:
            yield d
            produced += 1
            seq.append(d)
        tok = nxt

