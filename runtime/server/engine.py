"""The engine: one model, one ``Session``, a FIFO of requests computed one at a time in one thread.

nano-vllm's shape (a request queue, a step loop, a thin API layer) with one sequence at a time:
the expert store streams the experts one sequence's tokens miss, and a second sequence would miss
others, so concurrent slots would mostly add PCIe traffic on the GPUs this serves. The GPU work
runs in one dedicated thread; the asyncio routes hand it a ``Job`` and read what its ``TokenSink``
posts back. The sink runs in the engine thread, per token, so a stop sequence ends generation at
the token that completes it, and cancelling (a client gone) stops it within a token.

Every request's prompt goes through ``Session.prompt``: the prefix shared with the previous
request is kept (KV rows, DeltaNet checkpoints) wherever that gives a fresh run's bits. With a
conversation cache (``runtime.conversation_cache``) the engine first asks it for the entry that
keeps more of the prompt than the live sequence (another conversation, a shared system prompt)
and the session resumes from it; after the request the live state becomes an entry.

Between requests the same thread does the placement learning's work (``BetweenRequests``:
saving the profile, moving experts, a background bootstrap), never while a request runs; a
request that arrives meanwhile waits for the step in progress only.
"""
from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..conversation_cache import ConversationCache
from ..generate import Session, TokenConstraint, continue_tokens
from ..options import SamplingOptions
from .errors import ApiError
from .request_split import RequestSplit, SplitClock

if TYPE_CHECKING:
    from ..sampling import Sampler

log = logging.getLogger("sparkpack.server")


@dataclass
class Outcome:
    """How a job ended and what it cost (usage and metrics read it)."""

    finish: str = "stop"  # stop (a stop token or string) | length | cancelled | error
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens kept from the previous request
    completion_tokens: int = 0
    error: str | None = None
    queued_seconds: float = 0.0
    first_token_seconds: float | None = None  # from arrival (queue wait included)
    prefill_seconds: float = 0.0  # its prompt's calls (prefilled in chunks: not the steps between them)
    decode_seconds: float = 0.0
    split: RequestSplit | None = None  # where the computed request's time went (benchmarks read it)


class TokenSink(Protocol):
    """Receives a job's tokens in the engine thread."""

    def started(self, outcome: Outcome) -> None:
        """The prompt is in the cache (``prompt_tokens``, ``cached_tokens`` known); tokens follow."""

    def token(self, token_id: int) -> bool:
        """One generated token; True ends generation here (a stop sequence completed)."""

    def end(self, outcome: Outcome) -> None:
        """Called once, last, whatever happened (also for a job cancelled in the queue)."""


@dataclass
class Job:
    ids: list[int]
    max_new: int
    sampling: SamplingOptions
    sink: TokenSink
    constraint: TokenConstraint | None = None  # a structured output's grammar (decoded one token at a time)
    # the request body's fields outside the API's schema: no product code reads them; a sampler or
    # hook injected into the engine may (the tests' forced replies: tests/hooked_server.py)
    extra: dict[str, Any] = field(default_factory=dict)
    arrived: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Stop generating within a token; a job still queued never starts."""
        self.cancelled.set()


def own_sampler(job: Job) -> Sampler | None:
    """The job's sampler by its own sampling options (None: greedy, argmax on the device)."""
    return job.sampling.sampler(len(job.ids))


class BetweenRequests(Protocol):
    """Work the engine thread does when no request runs (``runtime.learning.LiveLearning``).
    ``busy()`` says whether a request is waiting: long work checks it and yields."""

    def after_request(self, busy: Callable[[], bool]) -> None:
        """After each request (what must not wait; work that may, when none is waiting)."""

    def idle(self, busy: Callable[[], bool]) -> bool:
        """When the queue is empty; returns whether work is left (it is called again)."""


def reset_after_failure(session: Session) -> None:
    """Forget whatever state a failed request left in ``session`` (it is not trusted). A device
    that fails even that (a sticky CUDA error) is logged, not raised: the engine thread goes on,
    and the next requests fail with an error their clients see instead of waiting forever."""
    try:
        session.reset()
    except Exception:
        log.exception("resetting the session after a failure failed")


class Engine:
    """``submit`` queues a job (503 past ``max_queue`` waiting); one thread computes them in
    order. ``on_job`` (metrics) sees each finished job's outcome in that thread. ``between``: the
    work done between requests. ``sampler`` chooses a job's sampler (its own sampling options;
    a test injects one that forces a known reply), ``after_prefill`` sees each computed job's last
    prompt logits before its first token is chosen (a test dumps them, or raises to take the
    failure path): injected, never set from the command line."""

    def __init__(self, session: Session, stop_ids: frozenset[int], *, max_queue: int = 64,
                 on_job: Callable[[Job, Outcome], None] | None = None, between: BetweenRequests | None = None,
                 conversations: ConversationCache | None = None,
                 sampler: Callable[[Job], Sampler | None] = own_sampler,
                 after_prefill: Callable[[Job, torch.Tensor], None] | None = None):
        self.session = session
        self.conversations = conversations
        self.between = between
        self.stop_ids = stop_ids
        self.max_queue = max_queue
        self.on_job = on_job
        self.sampler = sampler
        self.after_prefill = after_prefill
        # the engine thread's seconds after the last request's last token, by step: its client's
        # end ("sink"), the conversation cache's ("cache": its state snapshot), the metrics', the
        # last piece of work between requests since ("between"); the next request's split reports
        # it (a request that comes right after another queues behind this work)
        self.after_work: dict[str, float] = {}
        self._ended = False  # a request ended since the last work between requests
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._running: Job | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="sparkpack-engine", daemon=True)
        self._thread.start()

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> Job | None:
        """The job being decoded, None between jobs (when ``between`` may move experts)."""
        return self._running

    @property
    def alive(self) -> bool:
        """Whether the engine thread still takes jobs (not after ``close``, nor after a failure
        no guard caught): /health says so, and a job is refused rather than left waiting."""
        return self._thread.is_alive()

    def submit(self, job: Job) -> None:
        if not self.alive:
            raise ApiError(503, "the server's engine has stopped (see its log); restart the server")
        if self._queue.qsize() >= self.max_queue:
            raise ApiError(503, f"the server is busy: {self._queue.qsize()} requests are waiting; retry later")
        self._queue.put(job)

    def cancel_all(self) -> None:
        """Cancel the running job and every queued one (each still ends with an outcome)."""
        with self._lock:
            if self._running is not None:
                self._running.cancel()
            for job in list(self._queue.queue):
                if job is not None:
                    job.cancel()

    def close(self, timeout: float = 30.0) -> None:
        """``cancel_all``, then stop the thread once it has ended them (the GPU is then idle)."""
        self.cancel_all()
        self._queue.put(None)
        self._thread.join(timeout)
        if self.conversations is not None:
            self.conversations.close()  # the conversation states queued for the disk are written

    def busy(self) -> bool:
        """A request (or the stop) is waiting."""
        return not self._queue.empty()

    def _next(self) -> Job | None:
        """The next job; while there is none, the work between requests."""
        self._between()
        return self._queue.get()

    def _between(self) -> None:
        """Work between requests (both engines, while none is in flight): what follows the
        requests that ended since (``after_request``, once), then idle work while none waits,
        queued on the device after the copies out of the last request's state (a bootstrap
        replay writes a session's rows; the learner's step, which reads its counts back, does
        not wait for them). Each piece's seconds go to ``after_work["between"]``: a request that
        arrives during one waits for it (the last piece is kept, whether one did or not)."""
        if self.between is None:
            return
        ended, self._ended = self._ended, False
        try:
            if ended:
                self._piece(self.between.after_request)
            if not self.busy() and self.conversations is not None:
                self.conversations.order_after_copies()
            while not self.busy() and self._piece(self.between.idle):
                pass
        except Exception:  # learning (or a device gone bad) must never take the engine thread down
            log.exception("work between requests failed")

    def _piece(self, work: Callable[[Callable[[], bool]], bool | None]) -> bool | None:
        t0 = time.perf_counter()
        try:
            return work(self.busy)
        finally:
            self.after_work["between"] = time.perf_counter() - t0

    def _loop(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            outcome = Outcome(prompt_tokens=len(job.ids), queued_seconds=time.perf_counter() - job.arrived)
            session = self.session
            if job.cancelled.is_set():
                outcome.finish, session = "cancelled", None  # (never reached the session)
            else:
                with self._lock:
                    self._running = job
                try:
                    self._run(job, outcome)
                except Exception as e:  # a bug or an out-of-memory: this request fails, the server goes on
                    log.exception("request failed")
                    outcome.finish, outcome.error = "error", f"{type(e).__name__}: {e}".splitlines()[0]
                    reset_after_failure(self.session)
                finally:
                    with self._lock:
                        self._running = None
            self._finish(job, outcome, session, keep=outcome.finish != "error")

    def _finish(self, job: Job, outcome: Outcome, session: Session | None, keep: bool) -> None:
        """``job`` is over (both engines): its client gets the end, the conversation cache the
        request's end (``session``, None: the request never reached one; ``keep``: it did not
        fail, its state may become an entry), the metrics the outcome. A failure of any of them
        (the client's sink, the cache, the metrics' callback with its trace file on a full disk)
        is logged, never raised: the engine thread goes on. Each step's seconds: ``after_work``."""
        t = [time.perf_counter()]
        try:
            job.sink.end(outcome)
        except Exception:
            log.exception("a request's sink failed")
        t.append(time.perf_counter())
        if self.conversations is not None and session is not None:
            try:
                self.conversations.request_ended(keep=keep, session=session)
            except Exception:  # the cache must never take the server down
                log.exception("keeping the conversation's state failed")
        t.append(time.perf_counter())
        if self.on_job is not None:
            try:
                self.on_job(job, outcome)
            except Exception:
                log.exception("a request's metrics failed")
        t.append(time.perf_counter())
        self.after_work = {step: b - a for step, a, b in zip(("sink", "cache", "metrics"), t, t[1:])}
        self._ended = True

    def _run(self, job: Job, outcome: Outcome) -> None:
        session = self.session
        timing = session.timing
        prefill0, decode0 = timing.prefill_seconds, timing.decode_seconds
        clock = SplitClock(self.conversations, session.model.store, session.model.device, job.arrived, self.after_work)
        resume = self.conversations.prepare(job.ids) if self.conversations is not None else None
        clock.mark("resume")
        logits = session.prompt(job.ids, marks=resume.marks if resume is not None else frozenset())
        clock.mark("prompt")
        if resume is not None:
            self.conversations.after_prompt(job.ids, resume)
        outcome.cached_tokens = session.reused
        job.sink.started(outcome)
        if self.after_prefill is not None:
            self.after_prefill(job, logits)
        outcome.prefill_seconds = timing.prefill_seconds - prefill0
        sampler = self.sampler(job)
        outcome.finish = "length"
        with contextlib.closing(continue_tokens(session, logits, sampler, job.max_new, self.stop_ids,
                                                job.constraint)) as tokens:
            for n, tok in enumerate(tokens, 1):
                if outcome.first_token_seconds is None:
                    outcome.first_token_seconds = time.perf_counter() - job.arrived
                    clock.mark("first_token")
                outcome.completion_tokens = n
                if job.sink.token(tok):
                    outcome.finish = "stop"
                    break
                if job.cancelled.is_set():
                    outcome.finish = "cancelled"
                    break
            else:
                if outcome.completion_tokens < job.max_new:
                    outcome.finish = "stop"  # a stop token
        outcome.decode_seconds = timing.decode_seconds - decode0
        outcome.split = clock.end()
