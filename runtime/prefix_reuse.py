"""Which rows of a session's cache a new prompt may keep, and the state copies that let it go back.

A chat or a server sends the whole re-rendered conversation each turn (``Session.prompt``); the
session keeps the longest prefix that gives the very bits a fresh session computes: the rows
written by the prefill calls a fresh session makes too (``runtime.call_plan``), with DeltaNet
states restored from checkpoints taken at those positions (``runtime.cache.StateCheckpoints``),
and so are the windows of sliding-window layers (Laguna) whose rings have wrapped past the
position: their copy is taken where a prompt's exact rows end. Rows written by a decode step or
by a call that started elsewhere are recomputed: the same tokens fed in other calls differ in
the last bits on the CPU (4e-7 on the tiny models), and on a GPU a decode step's projections
even take int8 activations.

``PrefixReuse`` is that bookkeeping for one session: the call ends and exact rows of what it
fed, the checkpoints, and the copy of the state at a call end (``runtime.sequence_state``,
for ``runtime.conversation_cache``). The session tells it each call it runs (``ended``); it
never runs a call itself.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .cache import STATE_CHECKPOINTS, Cache, RecurrentState, StateCheckpoints
from .call_plan import CallPlan, PlannedCall, call_end
from .sequence_state import SequenceState, restore


def shared_len(a: Sequence, b: Sequence, step: int = 1024) -> int:
    """How many items (tokens, or characters of a prompt's text) ``a`` and ``b`` share from the
    start. Compared a slice at a time (in C): one by one in Python, a long conversation costs
    many times more a request."""
    if type(a) is not type(b):  # (a list's slice never equals a tuple's)
        a, b = list(a), list(b)
    n, i = min(len(a), len(b)), 0
    while i < n and a[i:i + step] == b[i:i + step]:
        i += step
    return next((j for j in range(i, min(i + step, n)) if a[j] != b[j]), min(i + step, n))


class PrefixReuse:
    """The reuse bookkeeping of one session's ``cache`` (its calls planned by ``plan``; the model
    on ``device`` in ``dtype``). ``checkpoints``: how many DeltaNet state copies a prompt may go
    back to (models with DeltaNet layers)."""

    def __init__(self, cache: Cache, plan: CallPlan, device: torch.device, dtype: torch.dtype,
                 checkpoints: int = STATE_CHECKPOINTS):
        self.cache, self.plan, self.device, self.dtype = cache, plan, device, dtype
        # DeltaNet states are copied where each call keeps rows exact; rings' windows only where a
        # prompt's exact rows end (per call, Laguna's 512-token calls would each copy 60 MB),
        # earlier positions being in the rings while they last.
        self.recurrent = any(isinstance(la, RecurrentState) for la in cache.layers)
        self.checkpoints = StateCheckpoints(checkpoints) if self.recurrent or cache.windowed else None
        # Where a fresh session feeding the session's ``fed`` ends its calls, as far as ``fed``
        # decides it (``call_end``), from 0; the tokens after the last are in a call still open.
        self.cuts = [0]
        # Rows [0, exact) came from the calls a fresh session feeding ``fed`` makes (whole calls
        # from position 0): what ``prompt`` may keep. Always one of ``cuts``.
        self.exact = 0
        self.marks: frozenset[int] = frozenset()  # the last prompt's (``start``)

    def forget(self) -> None:
        """The sequence is gone (``Session.reset``): nothing is kept."""
        self.cuts = [0]
        self.exact = 0
        if self.checkpoints is not None:
            self.checkpoints.discard_after(0)

    def reusable(self, ids: list[int], fed: list[int]) -> int:
        """How many tokens of ``ids`` a prompt would keep of ``fed`` now (nothing is changed). A
        call end at the first token that differs counts only if ``ids`` end a call there too: a
        call that ended before a control token may not end where another token stands."""
        common = shared_len(ids, fed)
        limit = min(common, len(ids) - 1, self.exact)
        if limit == common and limit in self.cuts and limit > 0:
            before = max(c for c in self.cuts if c < limit)
            if call_end(ids, before, self.plan.call_tokens_at(before), self.plan.breaks) != limit:
                limit -= 1
        return self.restorable(limit)

    def start(self, ids: list[int], fed: list[int], marks: frozenset[int]) -> int:
        """A prompt of ``ids`` comes after ``fed``: go back to the longest prefix it keeps
        (``reusable``) and return its length. ``marks``: positions (call ends) whose states are
        copied on the way and kept until the next prompt, for ``state_at``."""
        self.cache.wrote(len(fed))
        self.marks = marks
        if self.checkpoints is not None:
            self.checkpoints.protect = set(marks)
        keep = self.reusable(ids, fed)
        if keep != self.cache.pos or keep != len(fed):
            if self.checkpoints is not None and (self.recurrent or not self.cache.keeps(keep)):
                self.checkpoints.restore(self.cache, keep)
            else:
                self.cache.rewind(keep)  # KV rows past it are masked, then overwritten
            if self.checkpoints is not None:
                self.checkpoints.discard_after(keep)
        self.cuts = [c for c in self.cuts if c <= keep]
        self.exact = keep
        return keep

    def restorable(self, limit: int) -> int:
        """The last position at most ``limit`` (at most ``exact``) that a prompt can go back to:
        where a fresh session ends a call with, on DeltaNet models, a state checkpoint, and on
        models with sliding-window rings, a checkpoint or the window still in the rings (0 always
        qualifies)."""
        best = max(c for c in self.cuts if c <= limit)
        if self.checkpoints is None:
            return best
        saved = max((p for p in self.checkpoints.positions if p <= best), default=0)
        if self.recurrent:
            return saved
        # (the cuts ascend, and a ring that holds a cut's window holds every later one's)
        return max(saved, next((c for c in reversed(self.cuts) if c <= best and self.cache.keeps(c)), 0))

    def ended(self, c: PlannedCall, save: bool) -> None:
        """Call ``c`` is launched (``save``: copy the DeltaNet states where it keeps rows exact; a
        group copied them layer by layer, ``copies_during``)."""
        self.cuts += c.passed
        if c.closes:
            self.cuts.append(c.end)
        self.cache.wrote(c.start + self.plan.rows(c))
        if c.keeps:
            self.exact = c.end
            if save and self.recurrent:
                self.checkpoints.save(self.cache)
            elif not self.recurrent and c.end in self.marks and self.checkpoints is not None \
                    and c.end not in self.checkpoints.saved and self.cache.keeps(c.end):
                self.checkpoints.save(self.cache, c.end)  # a ring's window at a mark (a group ends there)

    def copies_during(self, group: list[PlannedCall]) -> Callable[[int, int], None] | None:
        """The hook ``MoEModel.forward_calls`` calls after call ``i``'s block of layer ``il``, for
        a group run layer by layer: it copies that layer's DeltaNet state where call ``i`` keeps
        rows exact (no call's states exist whole at any one time). None: nothing to copy."""
        if not self.recurrent:
            return None
        copies = self.checkpoints.take(self.cache, [c.end for c in group if c.keeps])
        ends = {i: copies[c.end] for i, c in enumerate(group) if c.end in copies}
        if not ends:
            return None

        def after(i: int, il: int) -> None:
            if i in ends:
                self.checkpoints.copy_layer(ends[i], self.cache, il, group[i].end)
        return after

    def interrupted(self) -> None:
        """A group stopped part way (an exception): the copies taken for it hold states half copied."""
        if self.checkpoints is not None:
            self.checkpoints.discard_after(self.exact)

    def save_windows(self) -> None:
        """Copy the rings' windows where the exact rows end, if not yet copied there and still in
        the rings (models without DeltaNet states; those copy at every call end, windows too).
        Why there: the next request of a conversation repeats the prompt up to about where the
        reply starts, and the reply's tokens may have pushed that window out of the rings."""
        cp = self.checkpoints
        if cp is not None and not self.recurrent and self.exact and self.exact not in cp.saved \
                and self.cache.keeps(self.exact):
            cp.save(self.cache, self.exact)

    def state_at(self, fed: list[int], pos: int | None = None
                 ) -> tuple[list[int], list[int], list | None] | None:
        """What a copy of the sequence's state at ``pos`` (default ``exact``) is taken from: its
        tokens (of ``fed``), the call ends within them and the ``StateCheckpoints`` copy there
        (None: the cache's own rows serve); None where the session no longer holds that state
        (``pos`` not a call end no later than ``exact``, or a DeltaNet state or a ring's window
        without its copy). ``runtime.sequence_state`` copies it (``runtime.conversation_cache``:
        after a request, and at the marks of the last prompt)."""
        pos = self.exact if pos is None else pos
        if pos <= 0 or pos > self.exact or pos not in self.cuts:
            return None
        saved = self.checkpoints.saved.get(pos) if self.checkpoints is not None else None
        if saved is None and (self.recurrent or not self.cache.keeps(pos)):
            return None
        if saved is not None and self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # the copy into ``saved`` landed
        return fed[:pos], [c for c in self.cuts if c <= pos], saved

    def resume(self, state: SequenceState) -> None:
        """Put ``state`` into the cache (the cache's device rows no longer needed by copies still
        running) as if its tokens had been prefilled: a later prompt keeps them where it would
        have kept them."""
        restore(state, self.cache, self.device, self.dtype)
        self.cuts = list(state.cuts)
        self.exact = state.pos
        if self.checkpoints is not None:
            self.checkpoints.discard_after(0)
            if self.recurrent:  # (what ``restorable`` goes back to)
                self.checkpoints.save(self.cache, state.pos)
