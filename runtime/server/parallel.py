"""``--parallel N``: up to N requests in flight, their sequences decoded together, one token each
per step (continuous batching; nano-vllm's scheduler is the model).

A waiting list (the queue), a joining list and a running list. At every step the requests that
arrived take a free session (one of N kept between requests: the free session whose previous
sequence shares the most of the prompt keeps it, unless the conversation cache holds a state that
keeps more, which that session resumes from, as the serial engine's one session does; a request
finding no free session waits in the queue) and join: their prompts are prefilled
(``Session.start_prompt``) at most ``step_tokens`` prompt tokens per step, the prompt with the
fewest tokens left first, so a short request that arrives during a long prompt is answered before
it. Then each running sequence takes its next token from its last logits, and those still running
decode one batched step (``runtime.batch_step.decode_together``); a prompt whose prefill is done
takes its first token at that step. A sequence that finishes, hits a stop, or whose client is gone
leaves at once (a prompt midway too: the session keeps what it fed, a shorter prompt's whole
state), and its session takes the next waiting request. Each row of a batched step is the bits of
the sequence decoding alone (``MoEModel.decode_batch``), and a prompt fed in chunks runs the calls
of a one-shot prompt (``PromptFeed``), so a greedy reply is the one the serial engine gives.

Chunked prefill is vLLM's (a token budget per step, running sequences first); here the step's
prefill work runs as its own calls beside the batched decode step, not in one forward with it.
The budget counts whole call groups (a prompt's calls are cut by ``runtime.call_plan``, a staged
group stays whole): a step runs at least one group, more while they fit. Why ``options.DEFAULT_STEP_TOKENS``
is one captured call's tokens: a GPU prompt already runs in calls of that size (on the models
that capture them; longer eager calls elsewhere and after a long past, one a step), so a
running stream's step grows by at most one call whatever the prompt's length, and the prompt
runs in the calls it runs in alone, paying only the decode steps between them. 0 feeds a joining
prompt whole before the step (the running streams wait for it).

On a GPU the batched step is replayed from a CUDA graph per set of sessions (``runtime.graph.
BatchGraphs``; the rows in session order, so a set is one graph whatever order its requests came in).
A sequence decoding alone (the one-user case, the most common) takes its own captured step
launched ahead of the host, as the serial engine does (``runtime.decode_ahead``): read back first,
each token's host work (its client's stream, this loop) left the GPU idle between steps.

A structured output's grammar is applied per sequence, as in the serial engine. Work between requests (placement learning) runs when no
sequence is in flight.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric

from ..batch_step import decode_together, launch_together
from ..conversation_cache import ConversationCache, Resume
from ..decode_ahead import AheadSteps
from ..generate import PromptFeed, Session, choose_token, device_pick
from ..graph import BatchGraphs
from ..options import DEFAULT_STEP_TOKENS
from .engine import BetweenRequests, Engine, Job, Outcome, own_sampler, reset_after_failure
from .metrics import PREFIX
from .request_split import SplitClock

if TYPE_CHECKING:
    from ..sampling import Sampler

log = logging.getLogger("sparkpack.server")


@dataclass(eq=False)  # (one request: the lists find it by identity)
class Joining:
    """A request whose prompt is being prefilled: its session, the feed in progress, what the
    conversation cache resumed from, the session's prefill time when it began."""

    job: Job
    session: Session
    outcome: Outcome
    feed: PromptFeed
    resume: Resume | None
    prefill0: float
    clock: SplitClock  # where its time goes (``timings``' split_* keys), as the serial engine's


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


class ParallelEngine(Engine):
    """``engine.Engine``'s interface (``submit``, ``cancel_all``, ``close``, ``waiting``: its
    queue is the waiting list) over ``sessions`` (one per sequence in flight, all of one model).
    ``step_tokens``: the prompt tokens a step prefills (0: a joining prompt whole)."""

    def __init__(self, sessions: list[Session], stop_ids: frozenset[int], *, max_queue: int = 64,
                 on_job: Callable[[Job, Outcome], None] | None = None, between: BetweenRequests | None = None,
                 conversations: ConversationCache | None = None,
                 sampler: Callable[[Job], Sampler | None] = own_sampler,
                 after_prefill: Callable[[Job, torch.Tensor], None] | None = None,
                 step_tokens: int = DEFAULT_STEP_TOKENS):
        if not sessions or any(s.model is not sessions[0].model for s in sessions):
            raise ValueError("ParallelEngine: one session or more, all of one model")
        self.sessions = sessions
        # the batched step captured per set of sessions where their decode steps are (CUDA)
        self.graphs = BatchGraphs(sessions[0].model) if all(s.use_graphs for s in sessions) else None
        self.batch_sizes: Counter[int] = Counter()  # batched steps run, by their number of sequences
        self._flight: list[Running] = []  # the running list
        self._joining: list[Joining] = []  # prompts being prefilled
        self.step_tokens = step_tokens or None
        self._free = list(sessions)
        self._stopping = False
        super().__init__(sessions[0], stop_ids, max_queue=max_queue, on_job=on_job, between=between,
                         conversations=conversations, sampler=sampler, after_prefill=after_prefill)

    @property
    def running(self) -> int:
        return len(self._flight)

    @property
    def joining(self) -> int:
        """Requests whose prompt is being prefilled."""
        return len(self._joining)

    def cancel_all(self) -> None:
        """Cancel every running, joining and queued job (each still ends with an outcome)."""
        with self._lock:
            for r in [*self._flight, *self._joining]:
                r.job.cancel()
            for job in list(self._queue.queue):
                if job is not None:
                    job.cancel()

    # --- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not (self._stopping and not self._flight and not self._joining):
            try:
                if not self._turn():
                    return
            except Exception as e:  # outside each request's own guard: those in flight fail, the engine goes on
                log.exception("the engine's step failed")
                self._fail_all(e)

    def _turn(self) -> bool:
        """One turn of the loop: the requests that arrived join, the prompts advance, the running
        sequences take a step. False: the queue's end (``close``)."""
        if not self._flight and not self._joining:
            self._between()
            job = self._queue.get()  # nothing in flight: wait for a request
            if job is None:
                return False
            self._admit(job)
        while self._free and not self._stopping:  # the requests that arrived join this step
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            if job is None:
                self._stopping = True
                break
            self._admit(job)
        self._prefill()
        self._step()
        return True

    def _fail_all(self, e: Exception) -> None:
        """Every request in flight or joining ends in error (their sessions reset and free)."""
        for r in list(self._flight):
            self._failed(r, e)
        for j in list(self._joining):
            self._not_joined(j.job, j.session, j.outcome, e, j)

    def _admit(self, job: Job) -> None:
        """Give ``job`` a free session and start its prompt (``_prefill`` feeds it)."""
        outcome = Outcome(prompt_tokens=len(job.ids), queued_seconds=time.perf_counter() - job.arrived)
        if job.cancelled.is_set():
            outcome.finish = "cancelled"
            self._finish(job, outcome, None, keep=False)
            return
        session, cache, began = None, self.conversations, False
        try:
            session = session_for(job.ids, self._free, cache)
            self._free.remove(session)
            clock = SplitClock(cache, session.model.store, session.model.device, job.arrived, self.after_work)
            began = True  # (``prepare`` counts the request from its first line)
            resume = cache.prepare(job.ids, session) if cache is not None else None
            clock.mark("resume")
            feed = session.start_prompt(job.ids, marks=resume.marks if resume is not None else frozenset())
        except Exception as e:  # a bug or an out-of-memory: this request fails, the server goes on
            self._not_joined(job, session, outcome, e, began=began)
            return
        with self._lock:
            self._joining.append(Joining(job, session, outcome, feed, resume, session.timing.prefill_seconds, clock))

    def _prefill(self) -> None:
        """This step's prefill work: whole call groups of the joining prompts, the one with the
        fewest tokens left first, while they fit in ``step_tokens`` (at least one group); a
        prompt done joins the running list, one whose client is gone leaves."""
        budget = self.step_tokens
        for j in sorted(self._joining, key=lambda j: j.feed.left):
            if j.job.cancelled.is_set():
                self._given_up(j)
                continue
            if budget is not None and budget < j.feed.next_tokens and budget < self.step_tokens:
                continue  # (the step's budget is spent)
            try:
                fed = j.feed.advance(budget)
                if j.feed.done:
                    self._joined(j)
            except Exception as e:  # a bug or an out-of-memory: this request fails, the others go on
                self._not_joined(j.job, j.session, j.outcome, e, j)
                continue
            if budget is not None:
                budget -= fed

    def _joined(self, j: Joining) -> None:
        """``j``'s prompt is in its session: it takes its first token at the step."""
        job, session, outcome, cache = j.job, j.session, j.outcome, self.conversations
        logits = j.feed.logits
        j.clock.mark("prompt")  # (with the other sequences' steps between its calls)
        if j.resume is not None:
            cache.after_prompt(job.ids, j.resume, session)
        outcome.cached_tokens = session.reused
        job.sink.started(outcome)
        if self.after_prefill is not None:
            self.after_prefill(job, logits)
        outcome.prefill_seconds = session.timing.prefill_seconds - j.prefill0
        outcome.finish = "length"
        r = Running(job, session, outcome, self.sampler(job), logits, list(session.fed),
                    decode0=session.timing.decode_seconds, clock=j.clock)
        with self._lock:
            self._joining.remove(j)
            self._flight.append(r)
        if job.max_new <= 0:
            self._leave(r)

    def _given_up(self, j: Joining) -> None:
        """``j``'s client is gone midway through its prompt: the session keeps the tokens fed (a
        shorter prompt's state, whose exact rows the cache keeps as any request's)."""
        with self._lock:
            self._joining.remove(j)
        j.outcome.finish = "cancelled"
        j.outcome.prefill_seconds = j.session.timing.prefill_seconds - j.prefill0
        self._free.append(j.session)
        self._finish(j.job, j.outcome, j.session, keep=True)

    def _not_joined(self, job: Job, session: Session | None, outcome: Outcome, e: Exception,
                    joining: Joining | None = None, began: bool = True) -> None:
        """``job`` (``joining``, if its prompt had begun) failed before its first token: its
        session's state (None: it had none yet) is not trusted; ``began``: the conversation cache
        saw it begin (it ends there too)."""
        with self._lock:
            if joining in self._joining:
                self._joining.remove(joining)
        log.exception("request failed")
        outcome.finish, outcome.error = "error", f"{type(e).__name__}: {e}".splitlines()[0]
        if session is not None:
            reset_after_failure(session)
            self._free.append(session)
        self._finish(job, outcome, session if began else None, keep=False)

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

    def _step(self) -> None:
        """Each running sequence takes its next token; those that go on decode one batched step,
        launched before the tokens are read where it can be (``_step_ahead``; a sequence decoding
        alone: its own step, ``_pick_ahead``)."""
        alone = len(self._flight) == 1
        if len(self._flight) > 1 and self._step_ahead():
            return
        going: list[tuple[Running, int]] = []
        for r in list(self._flight):
            try:
                tok, ahead = self._pick_ahead(r) if alone else (self._next_token(r), None)
            except Exception as e:  # a bug, a sampler gone wrong: this request fails, the others go on
                log.exception("request failed")
                self._failed(r, e)
                continue
            if not self._goes_on(r, tok):
                continue
            if ahead is not None:  # its step runs already
                r.logits = ahead
                self.batch_sizes[1] += 1
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
                self._failed(r, e)
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
        rows = sorted(self._flight, key=lambda r: self.sessions.index(r.session))  # a set: one graph
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
            host = torch.empty(len(rows), dtype=torch.long, pin_memory=tokens.is_cuda)
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
                self._failed(r, e)
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
            self._failed(r, e)
            return False
        if not goes:
            self._leave(r)
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

    def _failed(self, r: Running, e: Exception) -> None:
        r.outcome.finish, r.outcome.error = "error", f"{type(e).__name__}: {e}".splitlines()[0]
        reset_after_failure(r.session)
        self._leave(r)

    def _leave(self, r: Running) -> None:
        """``r`` is done: its session is free for the next request, its outcome reported."""
        with self._lock:
            self._flight.remove(r)
        self._free.append(r.session)
        r.outcome.decode_seconds = r.session.timing.decode_seconds - r.decode0
        try:
            r.outcome.split = r.clock.end() if r.clock is not None else None
        except Exception:  # (after a device failure): the request still ends, without its split
            log.exception("a request's split failed")
        self._finish(r.job, r.outcome, r.session, keep=r.outcome.finish != "error")


def session_for(ids: list[int], free: list[Session], cache: ConversationCache | None) -> Session:
    """The one of the ``free`` sessions that keeps the most of ``ids`` (its previous sequence's
    prefix); when the conversation ``cache`` keeps more, the one left longest ago (``free`` is
    in the order sessions were left), which the cache's state then replaces: the live sequences
    more likely to be continued stay where they are."""
    live = {id(s): s.reusable(ids) for s in free}
    best = max(free, key=lambda s: live[id(s)])
    if cache is not None and cache.keeps(ids, best) > live[id(best)]:
        best = free[0]
    return best


class BatchCollector:
    """``/metrics``' view of a ``ParallelEngine`` at scrape time: the sequences decoding, those
    whose prompt is being prefilled, and the decode steps' batch sizes, a histogram with a bucket per size up to ``--parallel`` (the
    waiting requests are ``sparkpack_requests_waiting``, each request's wait for a free sequence
    ``sparkpack_queue_wait_seconds``)."""

    def __init__(self, engine: ParallelEngine):
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(PREFIX + "running_sequences", "Sequences decoding now", value=self.engine.running)
        yield GaugeMetricFamily(PREFIX + "prefilling_sequences", "Requests whose prompt is being prefilled "
                                "(a few calls a step beside the decoding ones)", value=self.engine.joining)
        sizes = dict(self.engine.batch_sizes)  # (a copy: the engine thread adds to it)
        buckets, seen = [], 0
        for size in range(1, len(self.engine.sessions) + 1):
            seen += sizes.get(size, 0)
            buckets.append((str(float(size)), seen))  # (as prometheus_client writes a bound)
        buckets.append(("+Inf", seen))
        yield HistogramMetricFamily(PREFIX + "batch_size", "Sequences each decode step computed", buckets=buckets,
                                    sum_value=sum(size * n for size, n in sizes.items()))
