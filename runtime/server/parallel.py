"""``--parallel N``: up to N requests in flight, their sequences decoded together, one token each
per step (continuous batching; nano-vllm's scheduler is the model).

A waiting list (the queue), a joining list and a running list. At every step the requests that
arrived take a free session (one of N kept between requests: the free session whose previous
sequence shares the most of the prompt keeps it, unless the conversation cache holds a state that
keeps more, which that session resumes from, as the serial engine's one session does; a request
finding no free session waits in the queue) and join: their prompts are prefilled
(``Session.start_prompt``) at most ``step_tokens`` prompt tokens per step, the prompt with the
fewest tokens left first, so a short request that arrives during a long prompt is answered before
it. Then the running list (``server.running``) gives each running sequence its next token, and
those still running decode one step together, launched before the host reads their tokens; a
prompt whose prefill is done takes its first token at that step. A sequence that finishes, hits a
stop, or whose client is gone leaves at once (a prompt midway too: the session keeps what it fed,
a shorter prompt's whole state), and its session takes the next waiting request. Each row of a
batched step is the bits of the sequence decoding alone, and a prompt fed in chunks runs the calls
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

A structured output's grammar is applied per sequence, as in the serial engine. Work between requests (placement learning) runs when no
sequence is in flight.
"""
from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from prometheus_client.metrics_core import GaugeMetricFamily, HistogramMetricFamily, Metric

from ..conversation_cache import ConversationCache, Resume
from ..generate import PromptFeed, Session
from ..options import DEFAULT_STEP_TOKENS
from .engine import BetweenRequests, Engine, Job, Outcome, own_sampler, reset_after_failure
from .metrics import PREFIX
from .request_split import SplitClock
from .running import Running, RunningList

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
        self.rows = RunningList(sessions, stop_ids, self._left)  # the running list
        self._joining: list[Joining] = []  # prompts being prefilled
        self.step_tokens = step_tokens or None
        self._free = list(sessions)
        self._stopping = False
        super().__init__(sessions[0], stop_ids, max_queue=max_queue, on_job=on_job, between=between,
                         conversations=conversations, sampler=sampler, after_prefill=after_prefill)

    @property
    def running(self) -> int:
        return len(self.rows)

    @property
    def joining(self) -> int:
        """Requests whose prompt is being prefilled."""
        return len(self._joining)

    def cancel_all(self) -> None:
        """Cancel every running, joining and queued job (each still ends with an outcome)."""
        with self._lock:
            for r in [*self.rows, *self._joining]:
                r.job.cancel()
            for job in list(self._queue.queue):
                if job is not None:
                    job.cancel()

    # --- the engine thread ----------------------------------------------------------------------

    def _loop(self) -> None:
        while not (self._stopping and not self.rows and not self._joining):
            try:
                if not self._turn():
                    return
            except Exception as e:  # outside each request's own guard: those in flight fail, the engine goes on
                log.exception("the engine's step failed")
                self._fail_all(e)

    def _turn(self) -> bool:
        """One turn of the loop: the requests that arrived join, the prompts advance, the running
        sequences take a step. False: the queue's end (``close``)."""
        if not self.rows and not self._joining:
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
        self.rows.step()
        return True

    def _fail_all(self, e: Exception) -> None:
        """Every request in flight or joining ends in error (their sessions reset and free)."""
        for r in list(self.rows):
            self.rows.fail(r, e)
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
        self.rows.add(r)  # (before it leaves the joining list: ``cancel_all`` finds it in one of them)
        with self._lock:
            self._joining.remove(j)
        if job.max_new <= 0:
            self.rows.leave(r)

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

    def _left(self, r: Running) -> None:
        """``r`` left the running list: its session is free for the next request, its outcome reported."""
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
        sizes = dict(self.engine.rows.batch_sizes)  # (a copy: the engine thread adds to it)
        buckets, seen = [], 0
        for size in range(1, len(self.engine.sessions) + 1):
            seen += sizes.get(size, 0)
            buckets.append((str(float(size)), seen))  # (as prometheus_client writes a bound)
        buckets.append(("+Inf", seen))
        yield HistogramMetricFamily(PREFIX + "batch_size", "Sequences each decode step computed", buckets=buckets,
                                    sum_value=sum(size * n for size, n in sizes.items()))
