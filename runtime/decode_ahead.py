"""Decode-ahead: the next decode step is queued on the device before the host reads a token.

Why: read back at once, every token costs a host round trip in which the GPU idles (the read,
then the launch of the next step). Once the decode step is captured, the step that feeds token i
is launched from the device copy of i before the host reads i, so the GPU always has the next
step queued. A token the consumer then rejects (a stop token) has been fed already: the
session's ``fed`` includes it, as the cache does, so a later ``feed`` reuses or resets them as
usual. The tokens and logits are the bits ``feed`` gives one token at a time (same captured
step, same inputs).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch

from sparkpack.formats.profile import SIDES

from .graph import DecodeGraph
from .models.base import MoEModel

if TYPE_CHECKING:
    from .generate import Timing

GENERATED = SIDES[1]  # the side of the tokens fed here (``runtime.generate.GENERATED``)


class Decoding(Protocol):
    """What decode-ahead reads and moves of a session (``runtime.generate.Session``): the captured
    decode step it launches ahead (``graph``), the tokens fed and the timing it accounts them in,
    and the session's own ways back (``feed`` a token whose step was not launched ahead,
    ``reset`` when interrupted with a step fed whose token is unknown)."""

    model: MoEModel
    graph: DecodeGraph | None
    fed: list[int]
    timing: Timing

    def reset(self) -> None: ...

    def feed(self, ids: list[int], side: str) -> torch.Tensor: ...


class AheadSteps:
    """Decode-ahead one token at a time, for a loop that decides after each token whether it goes
    on (``decode_ahead``; the ``--parallel`` engine while one sequence decodes alone). Holds what
    spans tokens: the pinned word a token is read into and when the previous token was read (a
    step launched ahead is timed from one token read to the next, so the consumer's own time
    between tokens is inside it: ``Timing``)."""

    def __init__(self, session: Decoding, device: torch.device):
        self.session = session
        self.host: torch.Tensor | None = None  # (made at the first read: a batched step reads its own)
        self.stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        self.last = time.perf_counter()  # when the previous token was read (or a feed returned)
        self.queued: str | None = None  # the timing account of the step launched ahead last, not yet read

    def next(self, logits: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor], launch: bool
             ) -> tuple[int, torch.Tensor | None]:
        """The token ``pick`` chooses from ``logits`` (the last fed token's), read back after the
        step that feeds it is launched (``launch``: a token that may not be the last wanted) and
        then counted in ``fed``; with that step's logits, or None where no step was launched (not
        wanted, no captured step, past its KV room: the caller feeds the token itself, then
        ``fed_now``)."""
        session = self.session
        session.model.experts.routing_side(GENERATED)  # (the step launched ahead feeds a generated token)
        token = pick(logits).reshape(1)
        ready = None
        if self.stream is not None:
            if self.host is None:
                self.host = torch.empty(1, dtype=torch.long, pin_memory=True)
            self.host.copy_(token, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.stream)
        ahead = account = None
        if launch and session.graph is not None and session.graph.graph is not None:
            captures = session.graph.captures
            ahead = session.graph.step(token)  # None past the graph's KV room
            if ahead is not None:  # a step that captured again (after KV growth) is no decode step
                account = "capture" if session.graph.captures != captures else "decode"
        try:
            if ready is not None and self.host is not None:
                ready.synchronize()  # the token, not the step queued behind it
                tok = int(self.host[0])
            else:
                tok = int(token[0])
        except BaseException:  # interrupted with a step fed whose token is unknown: start afresh
            if ahead is not None:
                session.reset()
            raise
        self.settle()
        if ahead is not None:
            session.fed.append(tok)
            self.launched(account)
        return tok, ahead

    def launched(self, account: str) -> None:
        """A step feeding the token just read (and appended to ``fed``) was launched before the
        read: ``account`` ("decode", or "capture" for a step that captured again) says where its
        time goes once its logits are used (``settle``)."""
        self.queued = account
        self.session.timing.ahead_steps += 1

    def settle(self) -> None:
        """Count the step launched ahead last (its token was read, or its logits are about to be:
        the caller waits for them), from the previous token read to now."""
        if self.queued is None:
            return
        now = time.perf_counter()
        if self.queued == "decode":
            self.session.timing.decode_tokens += 1
            self.session.timing.decode_seconds += now - self.last
        else:
            self.session.timing.capture_seconds += now - self.last
        self.last, self.queued = now, None

    def fed_now(self) -> None:
        """The caller fed a token itself (its own timing): the next step launched ahead is timed from now."""
        self.last = time.perf_counter()


def decode_ahead(session: Decoding, logits: torch.Tensor, n: int, pick: Callable[[torch.Tensor], torch.Tensor],
                 seen: list[torch.Tensor] | None = None) -> Iterator[int]:
    """Up to ``n`` tokens after ``session``'s fed ones, whose last logits are ``logits``; ``pick``
    chooses each on the device (logits -> a token id tensor, nothing read back). ``seen``
    collects the logits each token was picked from (benchmarks compare them across
    residencies)."""
    steps = AheadSteps(session, logits.device)
    for i in range(n):
        if seen is not None:
            seen.append(logits)
        tok, ahead = steps.next(logits, pick, launch=i + 1 < n)
        yield tok
        if i + 1 == n:
            return
        if ahead is None:
            logits = session.feed(session.fed + [tok], GENERATED)
            steps.fed_now()
        else:
            logits = ahead
