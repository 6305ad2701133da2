"""Which prefill calls a session cuts a prompt into, and which of them run together.

Where calls end is a function of the tokens alone, read from the start (``call_end``): a
call ends after ``call_tokens`` tokens, or earlier before a break token (the chat template's
control tokens, where a message starts or ends) once it holds ``call_tokens // 8``. Why: the
next request of a conversation repeats this one's prompt up to about where the reply starts,
and ends in the middle of a fixed-size call; a call that ended before the last message's
control tokens lets it keep all but a few tokens of it (fixed 2048-token calls lose up to a
whole call of it). A schedule that looks only
backwards cuts a prompt and every longer prompt starting with it at the same places, so the
kept rows are those a fresh session computes (``runtime.prefix_reuse``).

``CallPlan`` is a session's schedule, fixed when the session is made: the call size (short
padded calls on the models whose prefill calls ``runtime.graph.PrefillGraphs`` pads, longer
eager ones after a long past), and where the expert store stages, the groups of calls that run
layer by layer. It decides; ``runtime.generate.Session`` runs what it decides.
"""
from __future__ import annotations

from dataclasses import dataclass

from sparkpack.formats.memory import LONG_PAST_TOKENS, PREFILL_GRAPH_TOKENS, group_tokens

from .cache import Cache
from .graph import PrefillGraphs, feeds_short_calls
from .models.base import MoEModel


def call_end(ids: list[int], start: int, call_tokens: int, breaks: frozenset[int]) -> int:
    """Where a fresh session's prefill call that starts at ``start`` ends (see the module
    docstring): before the first break token at least ``call_tokens // 8`` tokens in, else after
    ``call_tokens``. Reads only tokens before that end, so a longer ``ids`` agrees; an end past
    ``len(ids)`` is not decided yet (a prompt's last call)."""
    limit = start + call_tokens
    if breaks:
        for q in range(start + max(1, call_tokens // 8), min(limit, len(ids))):
            if ids[q] in breaks:
                return q
    return limit


@dataclass(frozen=True)
class PlannedCall:
    """One prefill call of a ``Session``'s feed: tokens ``[start, end)`` of the ids fed; ``closes``:
    it ends a fresh session's call (``call_end``); ``keeps``: the rows stay exact up to ``end``
    (a DeltaNet state copy is taken there); ``passed``: call ends decided before it, inside rows
    fed already."""

    start: int
    end: int
    closes: bool
    keeps: bool
    passed: list[int]


class CallPlan:
    """The prefill calls of one session (``cache``, opened with ``prefill_chunk`` and ``ctx``;
    ``padded``: its short calls are padded, ``PrefillGraphs``). ``breaks``: token ids a call may
    end before (``GGUFTokenizer.control_ids``); sessions compared bit for bit must have the same."""

    def __init__(self, model: MoEModel, cache: Cache, padded: bool, prefill_chunk: int, ctx: int,
                 breaks: frozenset[int] = frozenset()):
        self.model = model
        self.padded_calls = padded
        self.prefill_chunk = prefill_chunk
        self.breaks = breaks
        # Calls of at most PREFILL_GRAPH_TOKENS on such models even when the store cannot be
        # captured: the --vram plan counts those calls' temporaries, not prefill_chunk's.
        self.short_calls = feeds_short_calls(model, cache)
        # Models whose prefill calls are captured take every prompt in captured calls: replayed
        # 512-token calls are faster than eager 2048-token ones (docs/benchmarks-history.md,
        # session 15). Staging
        # (runtime.expert_staging, partial residency) keeps those calls: a residency must give
        # the all-GPU session's bits, and those come from the 512-token calls (on a GPU staged
        # 2048-token calls on qwen3moe changed tied routings: tests/test_calibrate_replay.py).
        # It runs them eagerly, padded as captured, in groups (``groups``).
        self.call_tokens = min(prefill_chunk, PREFILL_GRAPH_TOKENS) if self.short_calls else prefill_chunk
        # Except after a long past: there a call takes prefill_chunk tokens and runs eagerly, its
        # attention torch's fused kernel, faster than the captured calls' (LONG_PAST_TOKENS). The
        # switch depends on the position alone, so every residency makes the same calls.
        self.long_past = LONG_PAST_TOKENS if self.short_calls and prefill_chunk > self.call_tokens else None
        self.staged = model.experts.staged_prefill(self.call_tokens)
        self.group_tokens = group_tokens(ctx, self.call_tokens)  # what the --vram plan counts

    def call_tokens_at(self, start: int) -> int:
        """The tokens of a prompt call that starts at position ``start`` (``call_end`` may end it
        earlier): ``call_tokens``, or ``prefill_chunk`` after a long past (``long_past``)."""
        return self.prefill_chunk if self.long_past is not None and start >= self.long_past else self.call_tokens

    @property
    def longest_call(self) -> int:
        """The most tokens one prompt call of this session holds (eager calls after a long past
        included; padding is ``PrefillGraphs``' business)."""
        return self.prefill_chunk if self.long_past is not None else self.call_tokens

    def cuts_of(self, ids: list[int]) -> list[int]:
        """Where a fresh session feeding ``ids`` ends its calls before their last token (from 0)."""
        cuts = [0]
        while (end := call_end(ids, cuts[-1], self.call_tokens_at(cuts[-1]), self.breaks)) < len(ids):
            cuts.append(end)
        return cuts

    def calls(self, ids: list[int], n: int, start: int, exact: int) -> list[PlannedCall]:
        """The calls that feed ``ids[n:]`` after a past whose last call end is ``start`` and whose
        rows are exact up to ``exact``: they end where a fresh session's calls end
        (``call_end``), so rows computed from there are the ones it computes."""
        calls: list[PlannedCall] = []
        passed: list[int] = []
        i = n
        while i < len(ids):
            cut = call_end(ids, start, self.call_tokens_at(start), self.breaks)
            if cut <= i:  # decided by the new tokens, inside rows fed already (a decode step's)
                passed.append(cut)
                start = cut
                continue
            end = min(len(ids), cut)
            keeps = end == cut and i == exact == start  # a whole call from an exact row: still exact
            calls.append(PlannedCall(i, end, end == cut, keeps, passed))
            passed = []
            if end == cut:
                start = cut
                exact = end if keeps else exact
            i = end
        return calls

    def padded(self, c: PlannedCall) -> bool:
        """Whether call ``c`` is one ``PrefillGraphs`` pads (else it runs eagerly as it is)."""
        return self.padded_calls and PrefillGraphs.size(c.end - c.start) is not None

    def rows(self, c: PlannedCall) -> int:
        """The rows call ``c`` writes, padding included."""
        return PrefillGraphs.size(c.end - c.start) if self.padded(c) else c.end - c.start

    def groups(self, calls: list[PlannedCall], marks: frozenset[int]) -> list[list[PlannedCall]]:
        """``calls`` in groups of at most ``group_tokens`` tokens that run layer by layer, where
        the store stages (one call each elsewhere: a group would only hold more rows); padded
        and eager calls (after a long past) in groups of their own kind. A group ends at each of
        ``marks`` (positions whose states are copied: ``runtime.prefix_reuse``)."""
        if not self.staged:
            return [[c] for c in calls]
        groups: list[list[PlannedCall]] = []
        for c in calls:
            if groups and self.padded(c) == self.padded(groups[-1][0]) and groups[-1][-1].end not in marks \
                    and sum(g.end - g.start for g in groups[-1]) + c.end - c.start <= self.group_tokens:
                groups[-1].append(c)
            else:
                groups.append([c])
        return groups

    def stages(self, group: list[PlannedCall]) -> bool:
        """Whether a group of ``group``'s calls stages its cold experts (its rows, padding included)."""
        return self.model.experts.staged_prefill(sum(self.rows(c) for c in group))
