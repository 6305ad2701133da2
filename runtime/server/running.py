"""The running list of a ``--parallel`` engine (``server.parallel``): the requests decoding, each
in its own session, and the decode steps that give each its next token.

At every step each running sequence takes its next token from its last logits, and those still
running decode one batched step (``runtime.batch_step``; on a GPU replayed from a CUDA graph per
set of sessions, ``runtime.graph.BatchGraphs``, the rows in session order, so a set is one graph
whatever order its requests came in). Each row of a batched step is the bits of the sequence
decoding alone (``MoEModel.decode_batch``), so a greedy reply is the one the serial engine gives.

Each step is launched before the host reads the tokens it feeds, as the serial engine decodes
(``runtime.decode_ahead``): a sequence alone (the one-user case, the most common) takes its own
captured step ahead (``AheadSteps``), several their batched step (``launch_together``). Read back
first, each token's host work (its client's stream, the engine's turn, the step's own launch) left
the GPU idle between steps. A reply whose token needs the host first (a grammar's mask, a sampler
that reads the history) takes its steps read back (``decode_together``), as alone.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..batch_step import decode_together, launch_together
from ..decode_ahead import AheadSteps
from ..generate import Session, choose_token, device_pick
from ..graph import BatchGraphs
from .engine import Job, Outcome, reset_after_failure
from .request_split import SplitClock

if TYPE_CHECKING:
    from ..sampling import Sampler

log = logging.getLogger("sparkpack.server")


@dataclass(eq=False)
class Running:
    """A request in flight: its session, how it samples, what it generated, the logits its next
    token comes from."""

    job: Job
    session: Session
    outcome: Outcome
    sampler: Sampler | None
    logits: torch.Tensor
    history: list[int]
    generated: list[int] = field(default_factory=list)
    decode0: float = 0.0  # the session's decode time when the request joined
    greedy: int | None = None  # argmax of ``logits`` when the batched step already took it
    clock: SplitClock | None = None
    # while its steps are launched ahead (``_pick_ahead``, ``_step_ahead``): their reads and timing
    ahead: AheadSteps | None = None

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no grammar: its next token is the argmax of its logits."""
        return self.sampler is None and self.job.constraint is None


class RunningList:
    """The requests decoding in ``sessions`` (one per sequence in flight, all of one model) and
    their steps (``step``). ``ended(r)``: ``r`` has left the list (done, stopped, failed); its
    session is then free and its outcome to report (the engine's)."""

    def __init__(self, sessions: list[Session], stop_ids: frozenset[int], ended: Callable[[Running], None]):
        self.sessions = sessions
        self.stop_ids = stop_ids
        self._ended = ended
        # the batched step captured per set of sessions where their decode steps are (CUDA)
        self.graphs = BatchGraphs(sessions[0].model) if all(s.use_graphs for s in sessions) else None
        self.batch_sizes: Counter[int] = Counter()  # batched steps run, by their number of sequences
        self.rows: list[Running] = []
        self._lock = threading.Lock()  # (``cancel_all`` reads the list from another thread)
        # the tokens of a step launched ahead are read into it (a row per session; read before the
        # next step's are copied in, so one buffer serves every step)
        self._host: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[Running]:
        with self._lock:
            return iter(list(self.rows))

    def add(self, r: Running) -> None:
        with self._lock:
            self.rows.append(r)

    def leave(self, r: Running) -> None:
        """``r`` is done: out of the list, then ``ended``."""
        with self._lock:
            self.rows.remove(r)
        self._ended(r)

    def _next_token(self, r: Running) -> int:
        """``r``'s next token from ``r.logits``, chosen as the serial engine chooses it
        (``choose_token``), or the argmax the batched step already took."""
        if r.ahead is not None:  # it decoded alone until now: its last step launched ahead is counted
            r.ahead.settle()
            r.ahead = None
        if r.greedy is not None:
            tok, r.greedy = r.greedy, None
            return tok
        return choose_token(r.logits, r.sampler, r.job.constraint, r.history)

    def _pick_ahead(self, r: Running) -> tuple[int, torch.Tensor | None]:
        """The next token of ``r``, decoding alone, as the serial engine decodes
        (``runtime.decode_ahead``): the step that feeds it is launched before the host reads it,
        so the host's work on each token (the client's stream, this loop's next turn) overlaps a
        step rather than leaving the GPU idle. With that step's logits (None: no step launched,
        the token goes to ``decode_together``). Only where the pick needs nothing of the host; a
        grammar's or a history-reading sampler's reply goes through ``_next_token``. (An argmax
        the plain step read already is taken again on the device: the same token.)"""
        pick = device_pick(r.sampler, r.job.constraint)
        if pick is None:
            return self._next_token(r), None
        r.greedy = None
        if r.ahead is None:
            r.ahead = AheadSteps(r.session, r.logits.device)
        # (no step for a token that is the reply's last by length, as the serial engine's)
        return r.ahead.next(r.logits, pick, launch=r.outcome.completion_tokens + 1 < r.job.max_new)

    def step(self) -> None:
        """Each running sequence takes its next token; those that go on decode one batched step,
        launched before the tokens are read where it can be (``_step_ahead``; a sequence decoding
        alone: its own step, ``_pick_ahead``)."""
        alone = len(self.rows) == 1
        if len(self.rows) > 1 and self._step_ahead():
            return
        going: list[tuple[Running, int]] = []
        for r in list(self.rows):
            try:
                tok, ahead = self._pick_ahead(r) if alone else (self._next_token(r), None)
            except Exception as e:  # a bug, a sampler gone wrong: this request fails, the others go on
                log.exception("request failed")
                self.fail(r, e)
                continue
            if ahead is not None:  # its step runs already (counted as a batched step's is, stop or not)
                self.batch_sizes[1] += 1
            if not self._goes_on(r, tok):
                continue
            if ahead is not None:
                r.logits = ahead
            else:
                going.append((r, tok))
        if not going:
            return
        going.sort(key=lambda g: self.sessions.index(g[0].session))  # a set's rows in one order: one graph
        try:
            logits = decode_together([r.session for r, _ in going], [t for _, t in going], self.graphs)
            # the greedy rows' argmax in one launch and one read (the same token as each row's own:
            # argmax is exact, ties to the first index), not a launch and a host wait per row; the
            # read is where a failure of the step's kernels surfaces
            greedy = torch.argmax(logits, dim=-1).tolist() if any(r.plain_greedy for r, _ in going) else None
        except Exception as e:  # every sequence of the step fails; the server goes on
            log.exception("a batched step failed")
            for r, _ in going:
                self.fail(r, e)
            return
        self.batch_sizes[len(going)] += 1
        for i, (r, _) in enumerate(going):
            r.logits = logits[i]
            r.greedy = greedy[i] if greedy is not None and r.plain_greedy else None
            if r.ahead is not None:  # (its next step launched ahead is timed from here)
                r.ahead.fed_now()

    def _step_ahead(self) -> bool:
        """The running sequences' next tokens picked on the device and their batched step launched
        before the host reads them, as a sequence alone (``_pick_ahead``) and the serial engine
        decode: the host's work on the tokens (each client's stream, the prompts that join, this
        loop's next turn) overlaps the step instead of leaving the GPU idle, the tokens and logits
        those of the plain path (the same picks, the same captured step). A token read that ends
        its reply (a stop) has been fed, as in the serial engine. Each row's steps are timed as
        ``AheadSteps`` times them: from one token read to the next, once the step's logits are
        used (the prompt calls run between them included; a joining prompt's call, which waits
        for the device, includes the rest of the step). Only where the step is captured
        (``graphs``), every row's pick needs nothing of the host and none takes its last token by
        length (its step would be wasted); False: the plain path."""
        rows = sorted(self.rows, key=lambda r: self.sessions.index(r.session))  # a set: one graph
        if self.graphs is None or any(r.outcome.completion_tokens + 1 >= r.job.max_new for r in rows):
            return False
        picks = [device_pick(r.sampler, r.job.constraint) for r in rows]
        if any(p is None for p in picks):
            return False
        for r in rows:
            r.greedy = None  # (an argmax the plain step read already: taken again on the device, the same token)
            if r.ahead is None:
                r.ahead = AheadSteps(r.session, r.logits.device)
        try:
            tokens = torch.cat([pick(r.logits).reshape(1) for pick, r in zip(picks, rows)])
            if self._host is None:
                self._host = torch.empty(len(self.sessions), dtype=torch.long, pin_memory=tokens.is_cuda)
            host = self._host[:len(rows)]
            host.copy_(tokens, non_blocking=True)
            ready = None
            if tokens.is_cuda:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tokens.device))
            captures = self.graphs.captures
            logits = launch_together([r.session for r in rows], tokens, self.graphs)
            if ready is not None:
                ready.synchronize()  # the tokens, not the step queued behind them
            ids = host.tolist()
        except Exception as e:  # every sequence of the step fails (their sessions reset); the server goes on
            log.exception("a batched step failed")
            for r in rows:
                self.fail(r, e)
            return True
        account = "capture" if self.graphs.captures != captures else "decode"  # (captures: out of the decode rate)
        self.batch_sizes[len(rows)] += 1
        for i, (r, tok) in enumerate(zip(rows, ids)):
            r.ahead.settle()  # the step these tokens were picked from, launched last time, if it was
            r.session.fed.append(tok)
            r.ahead.launched(account)
            r.logits = logits[i]
            self._goes_on(r, tok)
        return True

    def _goes_on(self, r: Running, tok: int) -> bool:
        """``_report`` of ``r``'s next token ``tok``; a request that ends there leaves, one whose
        report fails (a sink gone wrong) fails, the others going on."""
        try:
            goes = self._report(r, tok)
        except Exception as e:  # a bug, a sink gone wrong: this request fails, the others go on
            log.exception("request failed")
            self.fail(r, e)
            return False
        if not goes:
            self.leave(r)
        return goes

    def _report(self, r: Running, tok: int) -> bool:
        """``r``'s next token ``tok``, reported to its client: whether ``r`` goes on (else its
        outcome says why it ends here), as the serial engine's loop over ``continue_tokens``."""
        o = r.outcome
        if tok in self.stop_ids:
            o.finish = "stop"
            return False
        r.generated.append(tok)
        if o.first_token_seconds is None:
            o.first_token_seconds = time.perf_counter() - r.job.arrived
            if r.clock is not None:
                r.clock.mark("first_token")
        o.completion_tokens = len(r.generated)
        if r.job.sink.token(tok):
            o.finish = "stop"
        elif r.job.cancelled.is_set():
            o.finish = "cancelled"
        elif o.completion_tokens >= r.job.max_new:
            o.finish = "length"
        else:
            r.history.append(tok)
            return True
        return False

    def fail(self, r: Running, e: Exception) -> None:
        """``r`` ends in error (its session reset: its state is not trusted)."""
        r.outcome.finish, r.outcome.error = "error", f"{type(e).__name__}: {e}".splitlines()[0]
        reset_after_failure(r.session)
        self.leave(r)
