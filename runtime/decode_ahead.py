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


def decode_ahead(session: Decoding, logits: torch.Tensor, n: int, pick: Callable[[torch.Tensor], torch.Tensor],
                 seen: list[torch.Tensor] | None = None) -> Iterator[int]:
    """Up to ``n`` tokens after ``session``'s fed ones, whose last logits are ``logits``; ``pick``
    chooses each on the device (logits -> a token id tensor, nothing read back). ``seen``
    collects the logits each token was picked from (benchmarks compare them across
    residencies). A step launched ahead is timed from one token read to the next, so the
    consumer's own time between tokens is inside it (``Timing``)."""
    on_cuda = logits.is_cuda
    session.model.experts.routing_side(GENERATED)  # the steps launched ahead below too
    host = torch.empty(1, dtype=torch.long, pin_memory=on_cuda)
    stream = torch.cuda.current_stream(logits.device) if on_cuda else None
    last = time.perf_counter()  # when the previous token was read (or a feed returned)
    queued = None  # the timing account of the step launched ahead last time, not yet read
    for i in range(n):
        if seen is not None:
            seen.append(logits)
        token = pick(logits).reshape(1)
        ready = None
        if stream is not None:
            host.copy_(token, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(stream)
        ahead = account = None
        if i + 1 < n and session.graph is not None and session.graph.graph is not None:
            captures = session.graph.captures
            ahead = session.graph.step(token)  # None past the graph's KV room
            if ahead is not None:  # a step that captured again (after KV growth) is no decode step
                account = "capture" if session.graph.captures != captures else "decode"
        try:
            if ready is not None:
                ready.synchronize()  # the token, not the step queued behind it
                tok = int(host[0])
            else:
                tok = int(token[0])
        except BaseException:  # interrupted with a step fed whose token is unknown: start afresh
            if ahead is not None:
                session.reset()
            raise
        if queued is not None:  # reading this token waited for the step launched last time
            now = time.perf_counter()
            if queued == "decode":
                session.timing.decode_tokens += 1
                session.timing.decode_seconds += now - last
            else:
                session.timing.capture_seconds += now - last
            last = now
        queued = account
        if ahead is not None:
            session.fed.append(tok)
            session.timing.ahead_steps += 1
        yield tok
        if i + 1 == n:
            return
        if ahead is None:
            logits = session.feed(session.fed + [tok], GENERATED)
            last = time.perf_counter()
        else:
            logits = ahead
